"""A paged KV cache (PagedAttention's layout): the host's page pool hands out and takes back
pages exactly; writes, commits and attention through a page table compute what row buffers
compute, bit for bit on the same slots; a model's cached passes over pages give the logits
its passes over rows give."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import cache as kv
from specjax import models
from specjax.backend import Backend
from specjax.models import attention as attn
from specjax.serve.pages import NULL_PAGE, OutOfPages, PagePool, cached_pages, page_keys, pages_for
from tests.test_long_context import _split_case

PAGE = 4


def test_the_pool_hands_out_and_takes_back_every_page():
    pool = PagePool(num_pages=9, page_size=PAGE)  # 8 pages to hand out
    assert pool.capacity_tokens == 32 and pool.free_pages == 8 and pages_for(9, PAGE) == 3
    a = pool.grow("a", 5)  # 2 pages
    assert len(a) == 2 and NULL_PAGE not in a
    assert pool.grow("a", 8) == a and pool.grow("a", 3) == a  # enough already: nothing taken, nothing given back
    b = pool.grow("b", 16)
    assert len(b) == 4 and not set(a) & set(b) and pool.free_pages == 2
    with pytest.raises(OutOfPages, match="3 more pages wanted, 2 free of 8"):
        pool.grow("c", 12)
    assert pool.pages("c") == [] and pool.free_pages == 2  # a refused owner holds nothing
    with pytest.raises(OutOfPages):
        pool.grow("a", 20)  # 5 pages: 3 more
    assert pool.pages("a") == a  # a refused growth keeps what the owner held
    table = pool.table(["b", None, "a"], width=5)
    assert table.dtype == np.int32 and table.tolist() == [b + [0], [0] * 5, a + [0, 0, 0]]
    with pytest.raises(ValueError, match="holds 4 pages, more than the table's 3"):
        pool.table(["b"], width=3)
    assert pool.release("b") == 4 and pool.release("a") == 2 and pool.release("a") == 0
    assert pool.free_pages == 8 and pool.fits(32) and not pool.fits(33)
    with pytest.raises(ValueError, match="null page"):
        PagePool(num_pages=1, page_size=PAGE)


def test_page_keys_name_a_page_by_every_token_before_it_and_the_next():
    """Page j's key hashes the tokens of pages 0..j and the token after it; only pages whose
    positions and next token lie below length - 2 get one; a salt separates engines."""
    tokens = list(range(3, 17))  # 14 tokens: (14 - 2) // 4 = 3 pages
    keys = page_keys(tokens, PAGE)
    assert len(keys) == cached_pages(14, PAGE) == 3 and len(set(keys)) == 3
    assert page_keys(tokens + [99, 98], PAGE)[:3] == keys  # what comes later changes nothing before
    changed = tokens[:12] + [0] + tokens[13:]  # the token after page 2 (position 12)
    assert page_keys(changed, PAGE)[:2] == keys[:2] and page_keys(changed, PAGE)[2] != keys[2]
    early = [0] + tokens[1:]  # a token of page 0 changes every key after it
    assert not set(page_keys(early, PAGE)) & set(keys)
    assert page_keys(tokens, PAGE, salt=b"other model") != keys
    assert cached_pages(5, PAGE) == 0 and cached_pages(6, PAGE) == 1 and cached_pages(1, PAGE) == 0
    # A finished row's count (its caches' `held` // page_size): the same keys, as many as full
    # pages a token follows (13 of 14 tokens: 3 pages; the 4th has no next token).
    assert page_keys(tokens, PAGE, count=2) == keys[:2] and page_keys(tokens, PAGE, count=9) == keys
    assert len(page_keys(tokens + [99, 98], PAGE, count=9)) == 3 and len(page_keys(tokens + [99], PAGE, count=9)) == 3
    assert len(page_keys(tokens + [99, 98, 97], PAGE, count=9)) == 4


def test_cached_pages_are_shared_counted_and_evicted_least_recently_used_first():
    pool = PagePool(num_pages=9, page_size=PAGE)  # 8 pages
    a_keys, b_keys = [b"a0", b"a1", b"a2"], [b"b0", b"b1"]
    assert pool.share("a", a_keys) == 0  # nothing cached yet
    a = pool.grow("a", 16)  # 4 pages, the first 3 of which it writes in full
    pool.register("a", a_keys)
    assert pool.share("x", a_keys[:2] + [b"other"]) == 2 and pool.pages("x") == a[:2]  # the longest run
    assert pool.holders(a[0]) == 2 and pool.holders(a[3]) == 1
    with pytest.raises(ValueError, match="shares cached pages before it holds any"):
        pool.share("x", a_keys)
    pool.grow("x", 12)  # a page of its own after the two it shares
    assert len(pool.pages("x")) == 3 and pool.free_pages == 3
    pool.register("x", [b"a0", b"a1", b"x2"])  # already cached pages keep their keys; its own gets one
    assert pool.stats()["cached_pages"] == 4
    pool.release("a")  # a2 and a3 leave a; a2 stays cached, a3 is free; a0, a1 still held by x
    assert pool.holders(a[0]) == 1 and pool.free_pages == 5
    pool.release("x")
    assert pool.free_pages == 8 and pool.stats()["cached_pages"] == 4 and pool.owners() == []
    b = pool.grow("b", 4 * 4)  # 4 pages: the 4 free (uncached) ones, no eviction
    pool.register("b", b_keys)
    assert pool.stats()["cached_pages"] == 6 and set(b).isdisjoint(a[:3])
    c = pool.grow("c", 4 * 2)  # 2 more: the least recently used cached pages go: a2 (released first), then x's own
    assert pool.stats()["cached_pages"] == 4
    assert pool.share("d", a_keys) == 2 and pool.pages("d") == a[:2]  # a0, a1 survived: released last
    for owner in "bcd":
        pool.release(owner)
    assert pool.free_pages == 8 and len(set(b + c)) == 6
    held = pool.grow("f", 8)  # an owner still holding pages when the device's state is made anew
    pool.reset()
    assert pool.stats()["cached_pages"] == 0 and pool.share("e", a_keys) == 0 and pool.free_pages == 8
    assert pool.pages("f") == [] and pool.holders(held[0]) == 0 and pool.owners() == []
    pool.check()


def _paged(buffer, table, num_pages):
    """Row buffers [B, G, S, D] laid into a pool [P, G, page, D] by a page table [B, M]."""
    B, G, S, D = buffer.shape
    pool = jnp.full((num_pages, G, PAGE, D), jnp.nan, buffer.dtype)  # unheld pages: NaN, any read of them shows
    pages = buffer.reshape(B, G, S // PAGE, PAGE, D).transpose(0, 2, 1, 3, 4)  # [B, M, G, page, D]
    return pool.at[table].set(pages)


def _table(B, M, num_pages, seed=0):
    """Each row's M pages, scattered over the pool (page 0 never held)."""
    ids = np.random.default_rng(seed).permutation(np.arange(1, num_pages))[:B * M]
    return jnp.asarray(ids.reshape(B, M), jnp.int32)


def test_writes_and_reads_through_a_page_table_are_the_row_buffers():
    rng = np.random.default_rng(1)
    B, G, S, D, T = 3, 2, 24, 8, 5
    rows = jnp.asarray(rng.standard_normal((B, G, S, D)), jnp.float32)
    table = _table(B, S // PAGE, 40)
    pool = _paged(rows, table, 40)
    for first, count in ((0, S // PAGE), (2, 3), (5, 4)):
        got = kv.page_blocks(pool, table, jnp.int32(first), count)
        last = (S // PAGE - 1) * PAGE  # past the table: its last page's slots again
        want = rows[:, :, [s if s < S else last + s % PAGE for s in range(first * PAGE, (first + count) * PAGE)]]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    new = jnp.asarray(rng.standard_normal((B, T, G, D)), jnp.float32)
    slots = jnp.asarray([[2, 3, 4, 5, 6], [19, 20, 21, 22, 23], [21, 22, 23, 24, 25]], jnp.int32)  # past S: dropped
    want = kv.write(rows, new, slots)
    got = kv.write(pool, new, slots, pages=table)
    np.testing.assert_array_equal(np.asarray(kv.page_blocks(got, table, 0, S // PAGE)), np.asarray(want))
    held = np.zeros(40, bool)
    held[np.asarray(table).ravel()] = True
    assert np.isnan(np.asarray(got)[~held]).all()  # nothing written outside the rows' pages


@pytest.mark.parametrize("kind", ["causal", "window", "tree"])
def test_attention_through_a_page_table_equals_row_buffers(kind):
    """The split attention (prefix read in place + in-flight keys) over pages gives the row
    buffers' result: in one softmax and block by block, a CPU's blocks and a GPU's
    fixed-length loop, with rows' pages scattered over a pool whose other pages are NaN."""
    args, want = _split_case(kind, None, S=36, D=8)
    q, k, v, mask, cache_k, cache_v, prefix, floor, scale, cap = args
    B, M = cache_k.shape[0], 36 // PAGE
    table = _table(B, M, 30, seed=2)
    pools = [_paged(c, table, 30) for c in (cache_k, cache_v)]
    for backend in (Backend("cpu"), Backend("gpu", portable=True)):
        for block in (4, 12, 64):  # a page a block, three pages a block, one softmax
            dense = jax.jit(lambda *a: attn.cached_attention(*a, block=block, backend=backend))(*args)
            paged = jax.jit(lambda *a: attn.cached_attention(*a, block=block, backend=backend, pages=table))(
                q, k, v, mask, *pools, prefix, floor, scale, cap)
            np.testing.assert_allclose(np.asarray(paged), np.asarray(want), atol=2e-5, rtol=0)
            np.testing.assert_array_equal(np.asarray(paged), np.asarray(dense), err_msg=f"{backend} {block}")


def test_a_model_s_passes_over_pages_give_its_passes_over_rows():
    """A tiny Llama: a prefill, a chain's verification written in place, a tree's deferred
    pass with its accepted path committed, then a one-token pass: the logits of each and the
    cache's slots are those of the same passes over row buffers."""
    config = specjax.ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                 num_kv_heads=2, head_dim=8, intermediate_size=48, max_position_embeddings=64,
                                 norm_eps=1e-5, tie_word_embeddings=False)
    model = models.init(config, jax.random.key(0), jnp.float32)
    B, S = 2, 32
    rows = kv.KVCache.init(config, B, S)
    paged = kv.KVCache.init_paged(config, B, num_pages=40, page_size=PAGE, table_width=S // PAGE)
    paged = paged.replace(pages=_table(B, S // PAGE, 40, seed=3))
    tokens = jax.random.randint(jax.random.key(1), (B, 20), 0, 64)

    def run(cache):
        out = []
        _, cache = models.prefill(model, tokens[:, :9], cache, return_hidden=False)
        pos = jnp.broadcast_to(9 + jnp.arange(4), (B, 4))
        logits, _, cache = models.apply(model, tokens[:, 9:13], pos, cache)
        out.append(logits)
        start = jnp.full((B,), 13, jnp.int32)  # a tree: root, two children, one grandchild
        placement = kv.tree_placement(start, np.array([0, 1, 1, 2]), jnp.asarray(
            np.broadcast_to(np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool), (B, 4, 4))))
        logits, _, cache, pending = models.apply(model, tokens[:, 13:17], start[:, None] + jnp.array([0, 1, 1, 2]),
                                                 cache, placement=placement, defer=True)
        out.append(logits)
        cache = models.commit(model, cache, pending, jnp.array([[0, 2, 3], [0, 1, 0]], jnp.int32), start)
        logits, _, cache = models.apply(model, tokens[:, 17:18], jnp.full((B, 1), 16, jnp.int32), cache)
        out.append(logits)
        held = cache.k[1] if cache.pages is None else kv.page_blocks(cache.k[1], cache.pages, 0, S // PAGE)
        return out, held[:, :, :17]

    run = jax.jit(run)  # (not op by op: seconds)
    want, want_k = run(rows)
    got, got_k = run(paged)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(got_k), np.asarray(want_k), atol=1e-6, rtol=0)
    assert paged.max_len == rows.max_len == S
