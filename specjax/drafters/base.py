"""The drafter interface's records, and `grow`, the tree expansion that model drafters
(a second model, an early exit of the target) share: a chain is its one-child case."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.cache import KVCache, tree_placement
from specjax.drafters.vocab import to_target_vocab
from specjax.sampling import History, Sampling, argmax, fold_in, sample, warp
from specjax.sharding import declared_axes, replicated_rules
from specjax.tree import Tree


@struct.dataclass
class Features:
    """The target's final hidden states for the tokens the last verification pass kept,
    for drafters that read them (`wants_features`): hidden[:, j] is the state at position
    start + j, known for positions <= length - 2 (the last final token's is not computed
    until the next pass). Taken from the verification pass itself; nothing else is carried."""

    hidden: jax.Array  # [B, D+1, F]: the root's, then the accepted path's (F: E, or E per feature layer)
    start: jax.Array  # int32 [B]: the position of hidden[:, 0]

    AXES = {"hidden": ("batch", None, None), "start": ("batch",)}  # sharding.declared_axes


@struct.dataclass
class DraftRequest:
    target: Any  # the target Model
    target_cache: KVCache  # valid below length - 1; a drafter may write beyond, and returns it
    tokens: jax.Array  # int32 [B, S]: the loop's token buffer
    length: jax.Array  # int32 [B]: final tokens per row
    done: jax.Array  # bool [B]: finished rows; nothing drafted for them is used
    key: jax.Array  # one PRNG key per row [B]: its draws depend on nothing else
    sampling: Sampling  # [B] settings
    k_limit: jax.Array  # int32 [B]: no node deeper than this per row (<= the tree's depth)
    threshold: jax.Array  # float32 []: stop a row's drafting when the draft's confidence is lower
    features: Features | None = None  # for drafters that want the target's hidden states
    history: History | None = None  # what penalties read (`sampling.History`): a filtered program's
    grammar: Any = None  # the rows' constraints (`grammar.Automaton`), or None
    grammar_state: jax.Array | None = None  # int32 [B]: each row's state in it, at its root


@struct.dataclass
class Branch:
    """Tokens a drafter asks the loop to score in the verification pass beside the tree, under
    their own mask (lookahead's Jacobi window). Branch token x sits at position root + offsets[x]
    and sees the prefix, the root and the branch tokens `sees[x]` marks (itself included); no
    tree node sees a branch token, so verification is untouched. The loop hands the target's
    logits for them back through `drafter.observe(state, logits, active)`."""

    tokens: jax.Array  # int32 [B, X]
    offsets: np.ndarray  # int32 [X]: position minus the root's, >= 1
    sees: np.ndarray  # bool [X, X]


@struct.dataclass
class Resume:
    """A prefill that resumes part way (the paged engine's admission): the rows' caches hold
    positions < start already (pages of a cached prefix), and the pass computes the `width`
    positions from start on. A drafter with a cache of its own writes them into `cache`:
    its cache of these rows (a paged view: its pools, the rows' page tables), not a new one."""

    cache: KVCache | None  # the drafter's own cache of the rows (None: it keeps none)
    start: jax.Array  # int32 [B]: positions its cache holds already
    width: int = struct.field(pytree_node=False)  # positions computed: start .. start + width - 1

    @property
    def positions(self) -> jax.Array:
        """int32 [B, width]: the positions the pass computes."""
        return self.start[:, None] + jnp.arange(self.width, dtype=jnp.int32)[None, :]


@struct.dataclass
class Proposal:
    """A token tree per row. Node i (1..N) is tokens[:, i-1]; node 0 is the root, the row's
    last final token. Nodes come after their parents."""

    tokens: jax.Array  # int32 [B, N]
    # Each node's parent (0 = the root): numpy int32 [N] for a tree of fixed shape, which
    # the loop turns into masks at trace time, or int32 [B, N] for per-row trees.
    parents: Any
    valid: jax.Array  # bool [B, N]: proposed nodes (a valid node's parent is valid)
    # float32 [B, N, V]: the distribution each node was drawn from (warped like the
    # target's), or None when every node is deterministic (its q is one-hot).
    q: jax.Array | None
    branch: Branch | None = None  # extra tokens to score in the same pass, if the drafter asks


class Drafter:
    """The interface the decoding loop knows drafters by (see `specjax.drafters`); every
    drafter subclasses it (as a flax struct dataclass) and overrides resolve, start and
    propose. The defaults here are what a drafter that needs nothing more gets."""

    tree: Tree  # its shape once resolved: N nodes, depth
    target_room = 0  # slots past the root it writes in the target's cache (beyond its nodes)
    wants_features = False  # True: start gets hidden= and requests carry `Features`
    feature_layers = None  # None: features are the target's final-normed states; else the
    # outputs of these layers (1..L), concatenated (EAGLE-3)
    fixed_shape = False  # True: num_draft_tokens="auto" may not choose its shape
    keeps_cache = False  # True: its state holds a KVCache of its own, which `start` fills (`Resume`)

    def resolve(self, K: int | None) -> "Drafter":
        """The drafter with its shape set: its own tree, or a chain of K (static)."""
        raise NotImplementedError(f"{type(self).__name__} does not resolve its shape")

    def bind(self, target) -> "Drafter":
        """Checks the drafter against the target (and adapts to it); called once per request."""
        return self

    def on(self, backend) -> "Drafter":
        """The drafter bound to the backend of the program about to be built (a `Backend`):
        a drafter with a model of its own binds it (`Model.on`); one that runs the target's
        layers or its own reads the backend from the target it is handed. Default: itself."""
        return self

    def check_lengths(self, longest: int, max_new_tokens: int):
        """Raises where prompts of `longest` tokens plus max_new_tokens exceed what the
        drafter's own model can position."""

    def start(self, target, prompts, lengths, max_len: int, hidden=None, resume: Resume | None = None):
        """Its state before the loop (prompts [B, P], lengths [B]; hidden [B, P, E] when it
        wants features). resume: None, or where a prefill resumes (`Resume`): the rows'
        caches hold a prefix already; prompts are then the rows' whole token buffers and
        hidden the states at resume.positions [B, width, E] alone (only drafters that keep a
        cache read it: the loop passes it to no other)."""
        raise NotImplementedError(f"{type(self).__name__} does not start")

    def propose(self, state, request: DraftRequest):
        """-> (state, the target's cache, a `Proposal`)."""
        raise NotImplementedError(f"{type(self).__name__} does not propose")

    def sync(self, state, tokens: jax.Array, length: jax.Array, done: jax.Array):
        """Its state brought up to date with final tokens it has not seen, after steps that did
        not draft (tokens [B, S], length and done [B] as the loop holds them), so that the
        next `propose` needs no loop of its own. Default: nothing to do."""
        return state

    def held(self, state, tokens: jax.Array, length: jax.Array, features):
        """int32 [B]: the positions below which its own cache holds the row's final tokens'
        entries, as a prefill of them writes them (a paged engine keeps such pages for later
        requests with the same tokens); tokens [B, S], length [B] and features as the loop
        holds them. None (the default): it keeps no cache (`keeps_cache`)."""
        return None

    def observe(self, state, logits: jax.Array, active: jax.Array):
        """Reads the target's logits [B, X, V] for the `Branch` it proposed."""
        raise NotImplementedError(f"{type(self).__name__} proposed a Branch but does not observe its logits")

    def state_rules(self, rules: tuple) -> tuple:
        """Logical-axis rules for its state on a mesh whose target runs by `rules`: rows over
        data, the rest replicated (a drafter with a sharded model of its own overrides)."""
        return replicated_rules(rules)

    def state_axes(self, state):
        """The logical axes of its state (what `start` returns): a pytree of `sharding.Axes`
        with the state's structure, a name per dimension of each array ("batch": its rows,
        split over data by `state_rules` and written row by row when the engine inserts a
        request; None: not split; the names of `state_rules`, e.g. "kv_heads"). It is read,
        never guessed from shapes: an array all rows share names no "batch". Default: what
        the state declares (`sharding.declared_axes`): None, a KVCache (by CACHE_AXES), or
        a dataclass whose AXES table names every field's axes. Override for anything else."""
        return declared_axes(state, f"{type(self).__name__}'s state")


# forward(cache, tokens [B, W], positions [B, W], placement, features [B, W, F] | None)
#   -> (cache, logits [B, W, V'], features [B, W, F] | None)
# V' is the target's vocabulary, or a reduced draft vocabulary's Vd ids (`grow`'s vocab).
# `features` are per-node values a drafter passes from a node to its children (EAGLE's
# predicted hidden states); drafters that need none pass None.
Forward = Callable[[Any, jax.Array, jax.Array, Any, Any], tuple[Any, jax.Array, Any]]


def grow_cache_length(tree: Tree, max_len: int) -> int:
    """Slots of a drafter's own cache that `grow`s `tree` beside a loop whose cache holds
    max_len: those and depth + 1 more (its catch-up window may run past the last final token;
    the tree itself is held beside the buffers, KVCache.tree)."""
    return max_len + tree.depth + 1


def grow(forward: Forward, cache, logits0: jax.Array, start: jax.Array, request: DraftRequest,
         tree: Tree, features0: jax.Array | None = None, vocab: jax.Array | None = None):
    """Grows each row's tree from logits0 [B, V'], the draft's logits for the token after the
    root (and features0 [B, F], the root's features, if the drafter passes any), with the
    draft's cache (a KVCache, or anything a cacheless drafter carries) valid for positions
    < start [B]: a depth-d node is fed at position start + d - 1.

    vocab: None (logits over the target's vocabulary), or int32 [Vd], the increasing target
    ids a reduced draft vocabulary's logits are over: candidates are ranked, sampled and
    scored over those Vd (what the target's vocabulary with -inf elsewhere gives: the same
    argmax and top-k, the same q), fed and proposed as their target ids, and only the q of
    the N chosen nodes is spread over the target's vocabulary, once a step.

    Depth by depth, every frontier node's top_k candidates (or top_k samples for sampled
    siblings) form a [W, C] grid; the next frontier is picked from it (by the static tree's
    table, or the W of highest cumulative draft log-probability) and fed to the draft in
    one pass of W tokens, each seeing its own ancestors: a KVCache holds the tree beside its
    buffers (KVCache.hold_tree, node d*W + w of R = (D-1)*W), never writing it into them.
    The deepest candidates are never fed. A row stops growing at its k_limit or when its
    frontier's best confidence (max probability at temperature 1) falls below the
    threshold: its later candidates are invalid. The trip count is static (D - 1 passes,
    whatever the rows do): no step waits on the host for a predicate. Returns (cache, Proposal)."""
    B, V = logits0.shape
    D, W, C, R = tree.depth, tree.width, tree.top_k, tree.region
    if C > V:
        raise ValueError(f"the tree takes up to {C} candidates per node (ranks 0..{C - 1}), but the "
                         f"vocabulary has {V} tokens")
    # Sampled siblings are drawn from q unless every row is greedy (static): then they are
    # what drawing from the one-hot q gives, the argmax, and no q is built.
    sampled = tree.siblings == "sampled" and not request.sampling.greedy
    argmax_siblings = tree.siblings == "sampled" and request.sampling.greedy
    placed = isinstance(cache, KVCache) and not tree.is_chain  # tree masks over a cache
    # Drafted under the rows' own settings (their logit bias on the draft vocabulary's indices),
    # penalized as the target will be: a frontier node's path (f_path) counts as emitted; and
    # masked by the state a frontier node's path reaches in the rows' grammar (f_state).
    sampling = request.sampling if vocab is None else request.sampling.over(vocab)
    history = request.history if vocab is None or request.history is None else request.history.over(vocab)
    region_offsets = np.arange(R) // W  # held node r has depth r // W + 1, at position start + r // W
    if tree.is_static:
        expand_table, node_table = (jnp.asarray(t) for t in tree.frontier_tables)

    def grid(d, logits, logq, f_valid, f_score, f_path, going, key):
        """Candidates of depth d+1 from the frontier at depth d (logits and their log_softmax
        logq [B, W, V]; f_path: its nodes' paths, int32 [B, W, D] target ids, or None):
        tokens, log q, validity [B, W, C] and (sampled siblings) the distribution they were
        drawn from [B, W, V]."""
        q = None
        if sampled:
            q = warp(logits, sampling, None if history is None else history.at(f_path))
            tokens = sample(key, jnp.broadcast_to(q[:, :, None], (B, W, C, V)))
        elif argmax_siblings:
            tokens = jnp.broadcast_to(argmax(logits)[..., None], (B, W, C))
        else:
            tokens = jax.lax.top_k(logits, C)[1]
        score = f_score[:, :, None] + jnp.take_along_axis(logq, tokens, axis=-1)
        valid = jnp.broadcast_to(f_valid[:, :, None] & going[:, None, None], (B, W, C))
        if tree.is_static:
            valid &= node_table[d][None] > 0
        return tokens.astype(jnp.int32), score, valid, q

    def next_frontier(d, score, valid):
        """Which W cells of the depth-(d+1) grid (flat w*C + c) are expanded next."""
        flat_valid = valid.reshape(B, W * C)
        if tree.is_static:
            cells = jnp.broadcast_to(jnp.maximum(expand_table[d + 1], 0), (B, W))
            return cells, (expand_table[d + 1] >= 0)[None] & jnp.take_along_axis(flat_valid, cells, 1)
        ranked = jnp.where(flat_valid, score.reshape(B, W * C), -jnp.inf)
        cells = jax.lax.top_k(ranked, W)[1]
        return cells, jnp.take_along_axis(flat_valid, cells, 1)

    def expand(d, carry):
        """Depth d's candidates into the pool; returns the carry and the grid."""
        cache, logits, feats, f_valid, f_score, f_pool, f_sees, pool, going, f_path, f_state = carry
        if f_state is not None:
            allowed = request.grammar.allows(f_state, request.target.config.vocab_size)  # [B, W, V] target ids
            logits = jnp.where(allowed if vocab is None else allowed[..., vocab], logits, -jnp.inf)
        logq = jax.nn.log_softmax(logits, axis=-1)  # [B, W, V]
        confidence = jnp.exp(jnp.max(jnp.where(f_valid[..., None], logq, -jnp.inf), axis=(1, 2)))
        going = going & (d < request.k_limit) & (confidence >= request.threshold)
        tokens, score, valid, q = grid(d, logits, logq, f_valid, f_score, f_path, going, fold_in(request.key, d))
        if vocab is not None:  # indices into the draft vocabulary -> target ids
            tokens = vocab[tokens]
        parent = jnp.broadcast_to(f_pool[:, :, None], (B, W, C))
        pool = jax.tree.map(lambda buf, x: buf.at[:, d].set(x), pool, (tokens, score, valid, parent, q))
        return (cache, logits, feats, f_valid, f_score, f_pool, f_sees, pool, going, f_path, f_state), (tokens, score,
                                                                                                        valid)

    def step(d, carry):
        """Expands depth d and feeds its chosen W candidates: the frontier of depth d+1."""
        carry, (tokens, score, valid) = expand(d, carry)
        cache, _, feats, _, _, _, f_sees, pool, going, f_path, f_state = carry
        cells, n_valid = next_frontier(d, score, valid)
        take = lambda x: jnp.take_along_axis(x.reshape(B, W * C), cells, 1)  # noqa: E731
        if f_path is not None:  # each new frontier node's path: its parent's, then itself
            f_path = jnp.take_along_axis(f_path, (cells // C)[..., None], axis=1).at[:, :, d].set(take(tokens))
        if f_state is not None:  # each new frontier node's state: its parent's after its token
            f_state = request.grammar.step(jnp.take_along_axis(f_state, cells // C, axis=1), take(tokens))
        own = jax.nn.one_hot(d * W + jnp.arange(W), R, dtype=bool)  # [W, R]
        sees = jnp.take_along_axis(f_sees, (cells // C)[..., None], axis=1) | own[None]
        positions = jnp.broadcast_to(start[:, None] + d, (B, W))
        placement = tree_placement(start, region_offsets, sees, offset=d * W) if placed else None
        parent_feats = None if feats is None else jnp.take_along_axis(feats, (cells // C)[..., None], axis=1)
        cache, logits, feats = forward(cache, take(tokens), positions, placement, parent_feats)
        return cache, logits, feats, n_valid, take(score), d * W * C + cells, sees, pool, going, f_path, f_state

    pool = (jnp.zeros((B, D, W, C), jnp.int32), jnp.full((B, D, W, C), -jnp.inf),
            jnp.zeros((B, D, W, C), bool), jnp.full((B, D, W, C), -1, jnp.int32),
            jnp.zeros((B, D, W, V), jnp.float32) if sampled else None)
    first = jnp.arange(W)[None] == 0  # the root is the only frontier node at depth 0
    feats = None if features0 is None else jnp.broadcast_to(features0[:, None], (B, W) + features0.shape[1:])
    carry = (cache, jnp.broadcast_to(logits0[:, None], (B, W, V)), feats,
             jnp.broadcast_to(first, (B, W)) & ~request.done[:, None], jnp.zeros((B, W)),
             jnp.full((B, W), -1, jnp.int32), jnp.zeros((B, W, R), bool), pool, ~request.done,
             None if history is None else jnp.full((B, W, D), -1, jnp.int32),
             None if request.grammar is None else jnp.broadcast_to(request.grammar_state[:, None], (B, W)))
    if D > 1:  # (a depth-1 tree feeds nothing)
        carry = (cache.hold_tree(B, R) if placed else cache,) + carry[1:]
        carry = jax.lax.fori_loop(0, D - 1, step, carry)  # static bounds: a scan
        carry = (carry[0].drop_tree() if placed else carry[0],) + carry[1:]
    carry, _ = expand(D - 1, carry)  # the deepest candidates, never fed
    cache, (tokens, score, valid, parent, q) = carry[0], carry[7]
    return cache, _select(tree, tokens, score, valid, parent, q, vocab, request.target.config.vocab_size)


def _select(tree: Tree, tokens, score, valid, parent, q, vocab, vocab_size: int) -> Proposal:
    """The tree's N nodes out of the pool of candidates [B, D, W, C] (parent: pool index, -1
    for the root's children; q [B, D, W, V'] or None, over the draft vocabulary `vocab` where
    there is one: the chosen nodes' spread over the target's vocabulary_size ids)."""
    B, D, W, C = tokens.shape
    flat = lambda x: x.reshape(B, D * W * C)  # noqa: E731
    if tree.is_static:
        _, node_table = tree.frontier_tables
        cell = np.argsort(node_table.ravel(), kind="stable")[-tree.nodes:]  # node i's pool cell
        chosen = jnp.broadcast_to(jnp.asarray(cell), (B, tree.nodes))
        parents, valid_chosen = tree.parents, jnp.take_along_axis(flat(valid), chosen, 1)
    else:
        ranked = jnp.where(flat(valid), flat(score), -jnp.inf)
        chosen = jnp.sort(jax.lax.top_k(ranked, tree.nodes)[1], axis=1)  # parents before children
        verify_index = jnp.zeros((B, D * W * C + 1), jnp.int32).at[
            jnp.arange(B)[:, None], chosen].set(jnp.arange(1, tree.nodes + 1)[None])
        pool_parent = jnp.take_along_axis(flat(parent), chosen, 1)
        parents = jnp.where(pool_parent < 0, 0, jnp.take_along_axis(verify_index, jnp.maximum(pool_parent, 0), 1))
        # Closed under prefixes: a child never outscores its parent, and ties go to the
        # lower (parent's) index; a node whose parent was not kept is dropped regardless.
        valid_chosen = jnp.take_along_axis(flat(valid), chosen, 1) & ((pool_parent < 0) | (parents > 0))
    q_chosen = None
    if q is not None:
        q_chosen = jnp.take_along_axis(q.reshape(B, D * W, -1), (chosen // C)[..., None], axis=1)
        if vocab is not None:
            q_chosen = to_target_vocab(q_chosen, vocab, vocab_size, fill=0.0)
    return Proposal(tokens=jnp.take_along_axis(flat(tokens), chosen, 1), parents=parents,
                    valid=valid_chosen, q=q_chosen)


def verify_room(drafter) -> int:
    """Slots past the root one step writes in the target's cache (0 without a drafter): the
    tree's nodes, or the drafter's own writes where more (lookahead's window). One
    verification pass scores 1 + this many tokens."""
    return 0 if drafter is None else max(drafter.tree.nodes, drafter.target_room)


def shape_for(tree: Tree | None, K: int | None, siblings: str) -> Tree:
    """The tree a drafter proposes: its own, or a chain of K (`generate`'s num_draft_tokens).
    With a tree the tree fixes the shape, so a different K is an error."""
    if tree is None:
        return Tree.chain(4 if K is None else K, siblings)
    if not isinstance(tree, Tree):
        raise TypeError(f"tree must be a specjax.Tree, got {type(tree).__name__}")
    if K is not None and K != tree.nodes:
        raise ValueError(f"the tree fixes the draft's shape ({tree.nodes} nodes, depth {tree.depth}); "
                         f"num_draft_tokens={K} conflicts with it: leave num_draft_tokens unset")
    return tree
