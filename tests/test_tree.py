"""Token trees: shapes refused when malformed, one tree pass equal to full passes over each
path, greedy output equal to transformers' for every tree drafter, the joint distribution of
the first three sampled tokens exact for every sibling scheme (and not when the sibling
update is broken), and one compilation across prompts, keys and sampling parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import acceptance, models
from specjax.cache import KVCache, commit, tree_placement
from specjax.drafters.base import DraftRequest, grow
from specjax.loop import generate_loop
from specjax.models import apply
from specjax.sampling import Sampling
from specjax.tree import Tree, ancestors, depths
from tests import tiny
from tests.test_sampling import V, _chi_square_p, _tiny, _transformers_probs

MAX_NEW = 12
STATIC = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0)]


# ---- shapes ----------------------------------------------------------------------------


@pytest.mark.parametrize("make, message", [
    (lambda: Tree.from_paths([]), "at least one path"),
    (lambda: Tree.from_paths([(0,), (0,)]), r"path \(0,\) appears more than once"),
    (lambda: Tree.from_paths([(0,), (1, 0)]), r"no parent path \(1,\)"),
    (lambda: Tree.from_paths([(0,), ()]), "the empty path is the root"),
    (lambda: Tree.from_paths([(0,), (-1,)]), "ranks must be >= 0"),
    (lambda: Tree.from_paths([(0,)], siblings="beam"), "siblings must be one of"),
    (lambda: Tree(depth=2, top_k=2, nodes=7), "scores at most 6 candidates"),
    (lambda: Tree(depth=0, top_k=2, nodes=1), "depth must be an int >= 1"),
    (lambda: Tree(depth=2, top_k=2, nodes=3, siblings="sampled"), "sampled siblings need a static tree"),
    (lambda: Tree.chain(0), "a chain needs K >= 1"),
])
def test_malformed_trees_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_static_tree_tables():
    tree = Tree.from_paths([(1, 0), (0,), (1,), (0, 0), (0, 1), (0, 0, 0)])  # any order
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert (tree.depth, tree.top_k, tree.nodes, tree.width, tree.region) == (3, 2, 6, 2, 4)
    np.testing.assert_array_equal(tree.parents, [0, 0, 1, 1, 2, 3])
    np.testing.assert_array_equal(depths(ancestors(tree.parents)), [0, 1, 1, 2, 2, 2, 3])
    chain = Tree.chain(4)
    assert chain.is_chain and chain.siblings == "sampled" and chain.region == 3
    assert not Tree.from_paths([(0,), (1,)]).is_chain
    # per-row parents (jnp) give the same ancestors as the static ones (numpy)
    np.testing.assert_array_equal(ancestors(jnp.asarray(tree.parents)[None])[0], ancestors(tree.parents))


def test_a_tree_in_words():
    """str(tree) names a shape as the bench and the notebooks print it; repr stays the dataclass's."""
    assert str(Tree.chain(4)) == "chain 4"
    assert str(Tree(8, 2, 24)) == "tree d8 k2 n24"
    assert str(Tree.from_paths([(0,), (1,), (0, 0)])) == "static d2 k2 n3"
    assert repr(Tree(2, 2, 2)).startswith("Tree(depth=2, top_k=2, nodes=2")


def test_tree_and_num_draft_tokens_conflict(pair):
    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts([[3, 4, 5]], bucket=16)
    tree = Tree(depth=3, top_k=2, nodes=5)
    with pytest.raises(ValueError, match="num_draft_tokens=4 conflicts"):
        specjax.generate(target, padded, lengths, draft=specjax.DraftModel(drafts["near"], tree),
                         num_draft_tokens=4)
    with pytest.raises(ValueError, match="a chain, not a tree"):
        specjax.generate(target, padded, lengths, draft=specjax.PromptLookup(tree=tree))
    with pytest.raises(TypeError, match="tree must be a specjax.Tree"):
        specjax.generate(target, padded, lengths, draft=specjax.DraftModel(drafts["near"], tree=[(0,)]))


# ---- one tree pass == full passes over each path -------------------------------------


@pytest.mark.parametrize("name", ["llama", pytest.param("mistral", marks=pytest.mark.slow),  # window 5 < the paths
                                  pytest.param("gpt2", marks=pytest.mark.slow)])
def test_tree_pass_equals_full_passes_over_each_path(hf_folder, name):
    run_pass = jax.jit(models.apply, static_argnames=("exit_layer", "taps", "defer"))  # (not op by op: seconds)
    target = specjax.load_model(hf_folder(name)[0])
    tree = Tree.from_paths(STATIC)
    rng = np.random.RandomState(0)
    prefix_lengths = np.array([9, 4])  # ragged rows; the root is each row's last prefix token
    B, S, N = 2, 32, tree.nodes
    prefix = rng.randint(2, tiny.VOCAB, (B, 16))
    nodes = rng.randint(2, tiny.VOCAB, (B, N))
    cache = KVCache.init(target.config, B, S)
    positions = jnp.broadcast_to(jnp.arange(16), (B, 16))
    _, _, cache = run_pass(target, jnp.asarray(prefix), positions, cache)  # slots >= length-1 go stale
    start = jnp.asarray(prefix_lengths - 1)
    anc = ancestors(tree.parents)
    depth = depths(anc)
    verify = np.concatenate([prefix[np.arange(B), prefix_lengths - 1][:, None], nodes], axis=1)
    placement = tree_placement(start, depth, jnp.broadcast_to(anc, (B, N + 1, N + 1)))
    # A verification pass: its keys pending, none written; then the path to the deepest node committed.
    logits, _, unwritten, pending = run_pass(target, jnp.asarray(verify), start[:, None] + depth, cache,
                                            placement=placement, defer=True)
    sequences = [list(prefix[b, : prefix_lengths[b] - 1]) + list(verify[b, anc[i]])  # root .. node i
                 for b in range(B) for i in range(N + 1)]
    padded, ends = specjax.pad_prompts(sequences, bucket=8)  # right padding is never attended to
    full = np.asarray(specjax.forward(target, padded))[np.arange(len(sequences)), ends - 1]
    np.testing.assert_allclose(np.asarray(logits).reshape(B * (N + 1), -1), full, atol=1e-4)
    assert not pending.written
    for got, before in zip(jax.tree.leaves(unwritten), jax.tree.leaves(cache)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(before))
    kept = np.flatnonzero(anc[N])  # the root, then node N's ancestors and itself, by depth
    committed = commit(cache, pending, jnp.broadcast_to(jnp.asarray(kept), (B, kept.size)), start)
    _, _, plain = run_pass(target, jnp.asarray(verify[:, kept]), start[:, None] + jnp.arange(kept.size), cache)
    for got, want in zip(committed.k + committed.v, plain.k + plain.v):  # [B, G, S, D] each
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    # A drafter's passes over the same tree, a depth each (`grow`), the root in the cache and
    # the nodes held beside it (the deterministic passes too): each node's logits as the
    # verification pass gave them, the buffers untouched.
    node_depth = depth[1:]  # [N]: the paths go depth by depth, so each depth's nodes are consecutive
    for model in (target, target.replace(exact=True)):
        held = cache.hold_tree(B, N)
        for d in range(1, node_depth.max() + 1):
            at = np.flatnonzero(node_depth == d)
            sees = jnp.broadcast_to(anc[at + 1, 1:], (B, at.size, N))  # the node and its ancestors
            placement = tree_placement(start + 1, node_depth - 1, sees, offset=at[0])
            positions = jnp.broadcast_to(start[:, None] + d, (B, at.size))
            got, _, held = run_pass(model, jnp.asarray(nodes[:, at]), positions, held, placement=placement)
            np.testing.assert_allclose(np.asarray(got), np.asarray(logits)[:, at + 1], atol=1e-4,
                                       err_msg=f"depth {d}, exact={model.exact}")
        for got, before in zip(held.k + held.v, cache.k + cache.v):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(before))


# ---- greedy exactness ------------------------------------------------------------------


def _prompts(batch, seed):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(2, tiny.VOCAB, n)) for n in rng.randint(1, 14, batch)]


def _greedy_case(target, torch_model, prompts):
    """A ragged batch and what greedy decoding must give it: (padded, lengths, eos, the rows
    transformers generates), eos being row 0's fifth greedy token, so that row stops early."""
    padded, lengths = specjax.pad_prompts(prompts, bucket=16)
    eos = int(specjax.generate(target, padded, lengths, max_new_tokens=MAX_NEW).tokens[0, 4])
    return padded, lengths, eos, [tiny.transformers_greedy(torch_model, p, MAX_NEW, eos) for p in prompts]


TREE_DRAFTERS = {
    "model_dynamic": lambda d: specjax.DraftModel(d, Tree(depth=4, top_k=3, nodes=10)),
    "model_dynamic_wide": lambda d: specjax.DraftModel(d, Tree(depth=2, top_k=4, nodes=12)),
    "model_static": lambda d: specjax.DraftModel(d, Tree.from_paths(STATIC)),
    "model_depth_1": lambda d: specjax.DraftModel(d, Tree.from_paths([(0,), (1,), (2,)])),
    "model_one_child_chain": lambda d: specjax.DraftModel(d, Tree.from_paths([(0,), (0, 0), (0, 0, 0)])),
    "model_sampled_siblings": lambda d: specjax.DraftModel(d, Tree.from_paths(STATIC, "sampled")),
    "early_exit_dynamic": lambda d: specjax.EarlyExit(1, Tree(depth=3, top_k=2, nodes=6)),
    "early_exit_static": lambda d: specjax.EarlyExit(1, Tree.from_paths(STATIC)),
}


# (the suite's time on 2 cores: the others with -m slow)
IN_THE_DEFAULT_RUN = ("model_dynamic", "model_static", "model_sampled_siblings", "early_exit_dynamic")


@pytest.mark.parametrize("name", [n if n in IN_THE_DEFAULT_RUN else pytest.param(n, marks=pytest.mark.slow)
                                  for n in TREE_DRAFTERS])
def test_greedy_tree_equals_transformers(pair, name):
    """Ragged batch of 4, with an EOS that stops the first row mid-way."""
    target, drafts, torch_model = pair
    padded, lengths, eos, expected = _greedy_case(target, torch_model, _prompts(4, seed=len(name)))
    auto = specjax.generate(target, padded, lengths, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert tiny.rows(auto) == expected
    for draft in drafts.values():
        out = specjax.generate(target, padded, lengths, draft=TREE_DRAFTERS[name](draft),
                               max_new_tokens=MAX_NEW, eos_token_id=eos)
        assert tiny.rows(out) == expected, name
        np.testing.assert_array_equal(out.tokens, auto.tokens)
        assert out.num_tokens[0] < MAX_NEW  # the EOS row stopped early


@pytest.mark.slow  # the suite's time on 2 cores (-m slow runs it; docs/bench measures it on the shipped pair)
def test_tree_keeps_more_tokens_per_pass_than_its_chain(pair):
    """With the far draft (often wrong), a top-3 tree of the chain's depth keeps more tokens
    per target pass: a rejected first choice is often the target's second or third."""
    target, drafts, _ = pair
    padded, lengths = specjax.pad_prompts(_prompts(6, seed=3), bucket=16)

    def per_pass(drafter):
        out = specjax.generate(target, padded, lengths, draft=drafter, max_new_tokens=MAX_NEW)
        return float(out.num_tokens.sum() / out.stats.steps.sum())

    chain = per_pass(specjax.DraftModel(drafts["far"], Tree.from_paths([(0,), (0, 0), (0, 0, 0)])))
    tree = per_pass(specjax.DraftModel(drafts["far"], Tree(depth=3, top_k=3, nodes=12)))
    assert tree > chain + 0.2, (tree, chain)


def test_adaptive_depth_with_a_tree(pair):
    target, drafts, torch_model = pair
    prompts = _prompts(3, seed=9)
    padded, lengths = specjax.pad_prompts(prompts, bucket=16)
    out = specjax.generate(target, padded, lengths, draft=specjax.DraftModel(drafts["far"], Tree(4, 2, 8)),
                           max_new_tokens=MAX_NEW, adaptive_k=True, draft_threshold=0.2)
    assert tiny.rows(out) == [tiny.transformers_greedy(torch_model, p, MAX_NEW) for p in prompts]


def test_finished_rows_are_not_drafted_for(pair):
    """grow() proposes nothing for rows marked done, and runs its static D - 1 draft passes
    whatever the rows (no predicate is read on the host)."""
    target, drafts, _ = pair
    draft = drafts["near"]
    B, S = 2, 32
    cache = KVCache.init(draft.config, B, S)
    passes = []  # one entry per draft pass that runs (not per trace)

    def forward(cache, tokens, positions, placement=None, features=None):
        jax.debug.callback(lambda: passes.append(1))
        logits, _, cache = apply(draft, tokens, positions, cache, placement=placement)
        return cache, logits, None

    logits0 = jnp.asarray(np.random.RandomState(0).randn(B, tiny.VOCAB), jnp.float32)
    tree = Tree(depth=3, top_k=2, nodes=6)

    def request(done):
        return DraftRequest(target=target, target_cache=None, tokens=jnp.zeros((B, S), jnp.int32),
                            length=jnp.array([5, 7]), done=jnp.array(done), key=jax.random.key(0),
                            sampling=Sampling.make(), k_limit=jnp.array([3, 3]), threshold=jnp.float32(0))

    def proposal(done):  # (compiled: op by op it takes seconds)
        return jax.jit(lambda c: grow(forward, c, logits0, jnp.array([5, 7]), request(done), tree))(cache)[1]

    proposal_one = proposal([True, False])
    assert not proposal_one.valid[0].any() and proposal_one.valid[1].all()
    passes.clear()
    proposal_all = proposal([True, True])
    jax.effects_barrier()
    assert not proposal_all.valid.any()
    assert len(passes) == tree.depth - 1  # every row done, the passes run all the same: no predicate


def test_compiles_once_with_a_tree(pair):
    target, drafts, _ = pair
    drafter = TREE_DRAFTERS["model_dynamic"](drafts["near"])  # the shapes of its greedy case above

    def run(seed, **kw):
        padded, lengths = specjax.pad_prompts(_prompts(4, seed=seed), bucket=16)
        specjax.generate(target, padded, lengths, draft=drafter, key=jax.random.key(seed),
                         max_new_tokens=MAX_NEW, **kw)

    run(0)
    run(1, temperature=0.8)
    before = generate_loop._cache_size()
    run(2, temperature=1.3)
    run(3, eos_token_id=3)
    assert generate_loop._cache_size() == before, "a call of the same shapes and sampling kind recompiled generate"


# ---- sampling: the joint distribution of the first three tokens ------------------------

# 20,000 rows: a broken sibling update moves the chi-square statistic by ~0.4-0.7 per row
# (measured at 40,000 rows), so it fails by thousands of standard deviations; a deviation
# about 100 times subtler is still caught.
ROWS, PROMPT, SETTING = 20_000, [1, 2, 3, 1, 2], (1.3, 6, 0.9)  # temperature, top_k, top_p


@pytest.fixture(scope="module")
def tiny_pair():
    """The chi-square pair of test_sampling: V = 8, the draft accepts about three in four."""
    target = _tiny(0, 0.6)
    return target, _tiny(1, 0.15, base=target)


@pytest.fixture(scope="module")
def exact_joint(tiny_pair):
    """P(t1, t2, t3 | prompt) [V, V, V], enumerated with transformers' processors."""
    target, _ = tiny_pair
    seqs = np.array([PROMPT + [a, b] for a in range(V) for b in range(V)])
    logits = np.asarray(specjax.forward(target, seqs))  # [V*V, T, V]
    warp = lambda x: _transformers_probs(x, *SETTING)  # noqa: E731
    p1 = warp(logits[:1, len(PROMPT) - 1])[0]  # [V]
    p2 = warp(logits[::V, len(PROMPT)])  # [V] x [V]: the row with t2 = 0 for each t1
    p3 = warp(logits[:, len(PROMPT) + 1]).reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def _sampled_joint(target, drafter, seed=0):
    prompts = np.tile(np.array(PROMPT, np.int32), (ROWS, 1))
    out = specjax.generate(target, prompts, np.full(ROWS, len(PROMPT), np.int32), draft=drafter,
                           key=jax.random.key(seed), max_new_tokens=3, temperature=SETTING[0],
                           top_k=SETTING[1], top_p=SETTING[2])
    t = np.asarray(out.tokens)
    return np.bincount((t[:, 0] * V + t[:, 1]) * V + t[:, 2], minlength=V ** 3).reshape(V, V, V)


SAMPLING_DRAFTERS = {
    "model_dynamic_top_k": lambda d: specjax.DraftModel(d, Tree(depth=3, top_k=3, nodes=8)),
    "model_static_top_k": lambda d: specjax.DraftModel(d, Tree.from_paths(STATIC)),
    "model_static_sampled": lambda d: specjax.DraftModel(d, Tree.from_paths(STATIC, "sampled")),
    "early_exit_dynamic": lambda d: specjax.EarlyExit(1, Tree(depth=3, top_k=2, nodes=5)),
    # a reduced draft vocabulary: q is 0 at ids 1, 4 and 7, which only the target's own tokens reach
    "model_chain_reduced": lambda d: specjax.DraftModel(d, Tree.chain(3, "sampled")).with_vocab([0, 2, 3, 5, 6]),
}


@pytest.mark.parametrize("name", [n if n not in ("model_static_top_k", "early_exit_dynamic")
                                  else pytest.param(n, marks=pytest.mark.slow) for n in SAMPLING_DRAFTERS])
def test_tree_sampling_is_exact(tiny_pair, exact_joint, name):
    target, draft = tiny_pair
    observed = _sampled_joint(target, SAMPLING_DRAFTERS[name](draft))
    assert observed[exact_joint == 0].sum() == 0  # nothing outside top-k/top-p is ever drawn
    assert _chi_square_p(observed, exact_joint) > 1e-3


def test_a_sampled_row_of_the_chi_square_run_stays_small(tiny_pair):
    """The chi-square runs' program (a static tree with sampled siblings, top-k and top-p;
    `_sampled_joint`'s, whose compile the persistent cache holds after the test above), its
    memory read from XLA, not run: under 48 KB of temporaries a row (26 KB at this commit,
    as much as the greedy program's; a report of 0.73 MB a row meant 30 GB at 40,000 rows)."""
    from specjax.generate import compiled_memory

    target, draft = tiny_pair
    prompts = np.tile(np.array(PROMPT, np.int32), (ROWS, 1))
    analysis = compiled_memory(target, prompts, np.full(ROWS, len(PROMPT), np.int32),
                               draft=SAMPLING_DRAFTERS["model_static_sampled"](draft), key=jax.random.key(0),
                               max_new_tokens=3, temperature=SETTING[0], top_k=SETTING[1], top_p=SETTING[2])
    assert analysis.temp_size_in_bytes / ROWS <= 48_000, analysis.temp_size_in_bytes / ROWS


def _keep_rejected_sibling(r, q, x):
    """Broken: a rejected sibling is not removed from r (neither x nor q is taken out)."""
    return r


def _keep_rejected_mass(mass, p_x):
    """Broken: a rejected top-k sibling's mass is not taken out of r."""
    return mass


@pytest.mark.parametrize("name, rule, broken", [
    # (the suite's time on 2 cores: the second scheme's teeth with -m slow)
    pytest.param("model_static_top_k", "remove_rejected_mass", _keep_rejected_mass, marks=pytest.mark.slow),
    ("model_static_sampled", "remove_rejected", _keep_rejected_sibling)])
def test_broken_sibling_update_fails_the_test(tiny_pair, exact_joint, monkeypatch, name, rule, broken):
    """Proof that the three-token test has teeth for each scheme."""
    target, draft = tiny_pair
    monkeypatch.setattr(acceptance, rule, broken)
    jax.clear_caches()
    try:
        observed = _sampled_joint(target, SAMPLING_DRAFTERS[name](draft))
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert _chi_square_p(observed, exact_joint) < 1e-6


@pytest.mark.parametrize("deterministic", [False, True])
def test_chain_acceptance_at_once_equals_the_walk(deterministic):
    """A chain's acceptance, all nodes at once, gives what the node-by-node walk gives, bit for
    bit (the same uniforms, tests and draws): greedy and sampled, drafts drawn from q or
    deterministic (q one-hot, None), rows whose drafts stop early."""
    from specjax.acceptance import accept, accept_greedy

    B, N, V = 64, 4, 7
    keys = jax.random.split(jax.random.key(5), 4)
    p = jax.nn.softmax(2 * jax.random.normal(keys[0], (B, N + 1, V)), axis=-1)
    q = None if deterministic else jax.nn.softmax(2 * jax.random.normal(keys[1], (B, N, V)), axis=-1)
    best = jnp.argmax(p, axis=-1).astype(jnp.int32)
    # Drafts: the argmax often (long accepted runs), else random; some rows propose fewer.
    tokens = jnp.where(jax.random.uniform(keys[2], (B, N)) < 0.7, best[:, :N],
                       jax.random.randint(keys[3], (B, N), 0, V)).astype(jnp.int32)
    valid = jnp.arange(N)[None] < (jnp.arange(B) % (N + 1))[:, None]
    chain, walked = np.arange(N, dtype=np.int32), jnp.arange(N, dtype=jnp.int32)  # traced parents: the walk
    row_keys = jax.vmap(jax.random.key)(jnp.arange(B))
    at_once = accept(row_keys, tokens, chain, valid, q, p, N)
    walk = accept(row_keys, tokens, walked, valid, q, p, N)
    for a, b in zip(at_once, walk):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert 0 < int(at_once[0].sum()) < B * N  # accepts and rejections both ran
    for a, b in zip(accept_greedy(tokens, chain, valid, best, N), accept_greedy(tokens, walked, valid, best, N)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
