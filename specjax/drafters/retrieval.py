"""Retrieval drafting (REST, He et al. 2023): propose what followed the row's recent text
in a datastore of other text.

`Datastore`: token lists concatenated, each document followed by a separator (-1, never a
token), and a suffix array over every position that holds a token, built once on the host
with numpy (prefix doubling) and kept on the device as int32 (any vocabulary size).

`Retrieval`: inside the compiled loop, per row and with fixed shapes, it
  1. finds, for every span s = 1..max_span, the range of suffix-array entries that start
     with the row's last s tokens *and continue with a token* (two binary searches in jnp,
     a `fori_loop` of ceil(log2 A) steps over a gathered window), and keeps the longest
     span (at least min_span) that occurs;
  2. samples up to max_matches of those entries, evenly spaced over the range. Entries of
     one range are sorted by what follows the span, so equal continuations are runs and
     a continuation that fills a fraction f of the range fills about f of the sample;
  3. reads the next `depth` tokens after each sample (stopping at a separator) and builds
     the trie of these continuations: a node is a run of equal prefixes, weighted by its
     length (how many samples share it);
  4. keeps, per node, its `top_k` heaviest children and, of all nodes, the `nodes`
     heaviest (ties: shallower first, then earlier in the sample). A child never outweighs
     its parent and is never shallower, so what is kept is closed under prefixes.
A chain of K is the case top_k = 1: the single most frequent continuation, token by token.
Without a match a row proposes nothing and the step yields the target's own token.

Drafts are deterministic (q one-hot, never built; siblings are distinct tokens), so the
acceptance rule for top-k siblings keeps the output exactly the target's, greedy or sampled.
This module knows nothing of tokenizers or files beyond the datastore's own folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.drafters.base import DraftRequest, Drafter, Proposal, shape_for
from specjax.hf import CheckpointError, _read_json, check_regular
from specjax.tree import Tree

SEPARATOR = -1  # ends every document; never equal to a token
FORMAT, VERSION = "specjax-datastore", 1
_META, _TOKENS, _SUFFIXES = "datastore.json", "tokens.npy", "suffixes.npy"


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """int [M] -> int64 [M]: the start of every suffix in lexicographic order (prefix
    doubling: sort by rank pairs of 1, 2, 4, ... tokens; past the end sorts first)."""
    n = len(tokens)
    rank = np.unique(tokens, return_inverse=True)[1].reshape(-1).astype(np.int64) + 1  # 0: past the end
    order = np.argsort(rank, kind="stable")
    k = 1
    while k < n:
        second = np.zeros(n, np.int64)
        second[: n - k] = rank[k:]
        key = rank * (n + 2) + second
        order = np.argsort(key, kind="stable")
        ordered = key[order]
        rank = np.empty(n, np.int64)
        rank[order] = 1 + np.concatenate([[0], np.cumsum(ordered[1:] != ordered[:-1])])
        if rank[order[-1]] == n:  # all distinct: sorted for good
            break
        k *= 2
    return order


def _read_array(file: Path) -> np.ndarray:
    """A 1-D int32 .npy file. The header is read first and checked against the file's size,
    so a header that claims more than the file holds allocates nothing; pickles (object
    dtypes) are refused unread. A missing file raises FileNotFoundError, a bad one
    CheckpointError."""
    with check_regular(file).open("rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if read_header is None:
                raise ValueError(f"its .npy format version {version} is not 1.0 or 2.0")
            shape, _, dtype = read_header(f)
        except (ValueError, OSError, MemoryError, RecursionError) as e:  # parsing the header's literal can overflow
            problem = " ".join(str(e).split()) or f"its header cannot be parsed ({type(e).__name__})"
            raise CheckpointError(f"{file} is corrupt: {problem}") from None
        if dtype != np.int32 or len(shape) != 1:
            raise CheckpointError(f"{file} must be a 1-D int32 array, got {dtype} {shape}")
        size = os.fstat(f.fileno()).st_size - f.tell()
        if size != shape[0] * dtype.itemsize:
            raise CheckpointError(f"{file} is corrupt: its header claims {shape[0]} int32 values "
                                  f"({shape[0] * dtype.itemsize} bytes) but {size} bytes follow it")
        return np.fromfile(f, np.int32, shape[0])


@struct.dataclass
class Datastore:
    """Documents for retrieval. tokens int32 [M]: the documents, each followed by
    SEPARATOR; suffixes int32 [A]: every position holding a token (A = M - documents),
    ordered by the text that starts there."""

    tokens: jax.Array  # int32 [M]
    suffixes: jax.Array  # int32 [A]
    max_token: int = struct.field(pytree_node=False, default=0)  # for the vocabulary check

    @classmethod
    def build(cls, token_lists) -> "Datastore":
        """From token-id lists (one per document). Refused: no tokens at all, a list that is
        not 1-D integers, ids < 0 or >= 2**31 - 1."""
        if isinstance(token_lists, np.ndarray) and token_lists.ndim == 1:
            raise ValueError("Datastore.build takes a list of token-id lists (documents), not one flat list")
        docs = []
        for i, doc in enumerate(token_lists):
            a = np.asarray(doc)
            if a.size == 0:
                continue
            if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"document {i} must be a 1-D list of integer token ids, got "
                                 f"{a.dtype} of shape {a.shape}")
            if a.min() < 0 or a.max() >= 2**31 - 1:
                raise ValueError(f"document {i} holds token id {int(a.min() if a.min() < 0 else a.max())}; "
                                 f"ids must lie in [0, 2**31 - 1)")
            docs.append(np.append(a.astype(np.int64), SEPARATOR))
        if not docs:
            raise ValueError("Datastore.build needs at least one non-empty document")
        tokens = np.concatenate(docs)
        if len(tokens) >= 2**31:
            raise ValueError(f"a datastore holds fewer than 2**31 tokens; these documents hold {len(tokens)}")
        order = suffix_array(tokens)
        suffixes = order[tokens[order] != SEPARATOR]
        return cls(jnp.asarray(tokens, jnp.int32), jnp.asarray(suffixes, jnp.int32), int(tokens.max()))

    @property
    def num_tokens(self) -> int:
        return int(self.suffixes.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.tokens.shape[0] - self.suffixes.shape[0])

    def save(self, path) -> None:
        """A folder: tokens.npy, suffixes.npy (int32) and datastore.json."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        np.save(path / _TOKENS, np.asarray(self.tokens, np.int32))
        np.save(path / _SUFFIXES, np.asarray(self.suffixes, np.int32))
        meta = {"format": FORMAT, "version": VERSION, "num_tokens": self.num_tokens,
                "num_documents": self.num_documents, "max_token": self.max_token}
        (path / _META).write_text(json.dumps(meta, indent=2) + "\n")

    @classmethod
    def load(cls, path) -> "Datastore":
        """A folder written by `save`. Missing or corrupt files raise CheckpointError."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"no datastore folder at {path}")
        try:
            meta = _read_json(path / _META)
        except FileNotFoundError:
            raise CheckpointError(f"{path} holds no {_META}: not a datastore folder") from None
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{path / _META} is not a specjax datastore (format {FORMAT!r} expected)")
        version = meta.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version != VERSION:
            raise CheckpointError(f"{path / _META} has version {version!r}; this specjax reads {VERSION}")
        for key in ("num_tokens", "num_documents", "max_token"):
            if isinstance(meta.get(key), bool) or not isinstance(meta.get(key), int):
                raise CheckpointError(f"{path / _META} has {key} {meta.get(key)!r}, not an integer")
        arrays = {}
        for name in (_TOKENS, _SUFFIXES):
            try:
                arrays[name] = _read_array(path / name)
            except FileNotFoundError:
                raise CheckpointError(f"{path} lacks {name}") from None
        tokens, suffixes = arrays[_TOKENS], arrays[_SUFFIXES]
        M, A = len(tokens), len(suffixes)
        problems = []
        if A != meta["num_tokens"] or M - A != meta["num_documents"]:
            problems.append(f"sizes ({A} tokens, {M - A} documents) differ from {_META}'s "
                            f"({meta['num_tokens']}, {meta['num_documents']})")
        elif M == 0 or tokens[-1] != SEPARATOR or tokens.min() < SEPARATOR or np.sum(tokens == SEPARATOR) != M - A:
            problems.append("tokens.npy is not documents each ended by -1")
        elif suffixes.min() < 0 or suffixes.max() >= M or (tokens[suffixes] == SEPARATOR).any():
            problems.append("suffixes.npy points outside the tokens or at separators")
        elif (np.diff(tokens[suffixes]) < 0).any():
            problems.append("suffixes.npy is not sorted")
        elif int(tokens.max()) != meta["max_token"]:
            problems.append(f"the largest token {int(tokens.max())} differs from {_META}'s {meta['max_token']}")
        if problems:
            raise CheckpointError(f"{path} is corrupt: {problems[0]}")
        return cls(jnp.asarray(tokens), jnp.asarray(suffixes), meta["max_token"])


def _compare(window, pattern, mask):
    """Lexicographic sign of window vs pattern over the masked positions: int32 [...]
    (-1, 0, 1) from int32 [..., W] windows and patterns, bool [..., W] masks."""
    differ = (window != pattern) & mask
    first = jnp.argmax(differ, axis=-1)[..., None]
    below = jnp.take_along_axis(window, first, -1)[..., 0] < jnp.take_along_axis(pattern, first, -1)[..., 0]
    return jnp.where(differ.any(-1), jnp.where(below, -1, 1), 0)


@struct.dataclass
class Retrieval(Drafter):
    """Drafts from a `Datastore` (see the module's docstring). tree: a dynamic
    `Tree(depth, top_k, nodes)` (top_k: children kept per node), or None for a chain of
    num_draft_tokens. Static rank-path trees are refused: the trie is each row's own."""

    datastore: Datastore
    max_span: int = struct.field(pytree_node=False, default=16)  # longest suffix looked up
    min_span: int = struct.field(pytree_node=False, default=1)  # shortest match that drafts
    max_matches: int = struct.field(pytree_node=False, default=64)  # occurrences read per row
    tree: Tree | None = struct.field(pytree_node=False, default=None)

    def resolve(self, K: int | None) -> "Retrieval":
        if not isinstance(self.datastore, Datastore):
            raise TypeError(f"Retrieval needs a specjax.Datastore, got {type(self.datastore).__name__}")
        for name in ("max_span", "min_span", "max_matches"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"Retrieval {name} must be an int >= 1, got {value!r}")
        if self.min_span > self.max_span:
            raise ValueError(f"Retrieval needs min_span <= max_span, got min_span={self.min_span}, "
                             f"max_span={self.max_span}")
        tree = shape_for(self.tree, K, "top_k")
        if tree.is_static and not tree.is_chain:
            raise ValueError("Retrieval grows each row's own trie: give a chain (num_draft_tokens) or a "
                             "dynamic Tree(depth, top_k, nodes), not rank paths")
        if tree.nodes > tree.depth * self.max_matches:
            raise ValueError(f"a trie of {self.max_matches} matches to depth {tree.depth} has at most "
                             f"{tree.depth * self.max_matches} nodes; the tree asks for {tree.nodes}")
        return self.replace(tree=tree)

    def bind(self, target) -> "Retrieval":
        vocab = target.config.vocab_size
        if self.datastore.max_token >= vocab:
            raise ValueError(f"the datastore holds token id {self.datastore.max_token}, outside the target's "
                             f"vocabulary [0, {vocab}): it was built with another tokenizer")
        return self

    def start(self, target, prompts, lengths, max_len, hidden=None):
        return None

    def propose(self, state, request: DraftRequest):
        text, length = request.tokens, request.length  # [B, S], [B]
        B, S = text.shape
        L, Mm = self.max_span, self.max_matches
        D, C, N = self.tree.depth, self.tree.top_k, self.tree.nodes
        corpus, suffixes = self.datastore.tokens, self.datastore.suffixes  # [M], [A]
        M, A = corpus.shape[0], suffixes.shape[0]

        def read(starts, width):  # corpus[starts + i] for i < width, -1 past the end: [..., width]
            at = starts[..., None] + jnp.arange(width)
            return jnp.where(at < M, corpus[jnp.clip(at, 0, M - 1)], SEPARATOR)

        # Patterns [B, L, L+1]: span s = j+1 is the row's last s tokens, then a token 0 for
        # the lower bound (a match must be followed by a token, and -1 < 0 <= any token).
        span = jnp.arange(1, L + 1)[None, :, None]  # [1, L, 1]
        i = jnp.arange(L + 1)[None, None, :]  # [1, 1, L+1]
        at = length[:, None, None] - span + i
        pattern = jnp.where(i < span, text[jnp.arange(B)[:, None, None], jnp.clip(at, 0, S - 1)], 0)
        masks = jnp.stack([i <= span, i < span])  # [2, 1, L, L+1]: lower bound, upper bound

        def search(_, bounds):  # bounds int32 [2, B, L]: [lo, hi) of the first index >= / > pattern
            lo, hi = bounds
            mid = (lo + hi) // 2
            sign = _compare(read(suffixes[jnp.clip(mid, 0, A - 1)], L + 1), pattern[None], masks)
            right = jnp.where(jnp.arange(2)[:, None, None] == 0, sign < 0, sign <= 0) & (lo < hi)
            return jnp.where(right, mid + 1, lo), jnp.where(right | (lo >= hi), hi, mid)

        steps = int(np.ceil(np.log2(A + 1))) + 1
        bounds = (jnp.zeros((2, B, L), jnp.int32), jnp.full((2, B, L), A, jnp.int32))
        first, _ = jax.lax.fori_loop(0, steps, search, bounds)
        count = first[1] - first[0]  # [B, L]: occurrences of each span followed by a token
        usable = (count > 0) & (span[..., 0] >= self.min_span) & (span[..., 0] <= length[:, None])
        best = jnp.argmax(jnp.where(usable, jnp.arange(L)[None], -1), axis=1)  # [B]: span best+1
        found = usable.any(1) & ~request.done
        lo = jnp.take_along_axis(first[0], best[:, None], 1)[:, 0]
        count = jnp.where(found, jnp.take_along_axis(count, best[:, None], 1)[:, 0], 0)  # [B]

        # Up to Mm samples of the range, evenly spaced (in suffix-array order, so sorted by
        # continuation); (count * m) // Mm without overflow.
        m = jnp.arange(Mm)[None]  # [1, Mm]
        q, r = (count // Mm)[:, None], (count % Mm)[:, None]
        offset = jnp.where(count[:, None] > Mm, q * m + (r * m) // Mm, m)
        taken = m < count[:, None]  # [B, Mm]
        starts = suffixes[jnp.clip(lo[:, None] + offset, 0, A - 1)] + best[:, None] + 1
        cont = read(starts, D)  # [B, Mm, D]: what followed each sample
        d = jnp.arange(D)[None, None]  # [1, 1, D]
        ok = taken[..., None] & (jnp.cumprod(cont >= 0, axis=2) > 0) & (d < request.k_limit[:, None, None])
        cont = jnp.where(ok, cont, -2 - m[..., None])  # a dead sample equals nothing else

        # The trie: a node is a run of samples with equal prefixes (depth d: tokens 0..d).
        same = jnp.cumprod(cont[:, 1:] == cont[:, :-1], axis=2) > 0  # [B, Mm-1, D]
        opens = jnp.concatenate([jnp.ones((B, 1, D), bool), ~same], axis=1)  # [B, Mm, D]: a run starts
        index = jnp.broadcast_to(jnp.arange(Mm)[None, :, None], (B, Mm, D))
        run = jax.lax.cummax(jnp.where(opens, index, 0), axis=1)  # [B, Mm, D]: start of m's run
        after = jax.lax.cummin(jnp.where(opens, index, Mm), axis=1, reverse=True)
        after = jnp.concatenate([after[:, 1:], jnp.full((B, 1, D), Mm)], axis=1)  # next run's start
        node = opens & ok  # [B, Mm, D]: m starts a run of depth d: a trie node
        weight = jnp.where(node, after - index, 0)  # samples sharing the prefix
        score = jnp.where(node, (weight * (D + 1) + (D - d)) * Mm + (Mm - 1 - index), -1)  # distinct per row
        parent = jnp.concatenate([jnp.zeros((B, Mm, 1), jnp.int32), run[..., :-1]], axis=2)  # its run at d-1

        # Keep each node's C heaviest children: rank among nodes of the same parent run.
        siblings = (parent[:, :, None] == parent[:, None]) & node[:, None]  # [B, Mm, Mm', D]
        rank = jnp.sum(siblings & (score[:, None] > score[:, :, None]), axis=2)  # [B, Mm, D]
        kept = node & (rank < C)
        # ... and only nodes whose ancestors were all kept: kept at every depth up to d.
        kept_run = jnp.take_along_axis(kept, run, axis=1)  # [B, Mm, D]: m's ancestor at each depth kept
        kept = kept & (jnp.cumprod(kept_run, axis=2) > 0)

        # The N heaviest, in depth-major order (parents first); then verification indices.
        flat = lambda x: jnp.swapaxes(x, 1, 2).reshape(B, D * Mm)  # noqa: E731  [B, D*Mm], cell d*Mm + m
        ranked = jnp.where(flat(kept), flat(score), -1)
        chosen = jax.lax.top_k(ranked, N)[1]
        valid = jnp.take_along_axis(ranked, chosen, 1) >= 0
        chosen = jnp.sort(jnp.where(valid, chosen, D * Mm + chosen), axis=1) % (D * Mm)  # valid first
        valid = jnp.take_along_axis(ranked, chosen, 1) >= 0
        tokens = jnp.take_along_axis(flat(cont), chosen, 1)
        tokens = jnp.where(valid, tokens, 0).astype(jnp.int32)
        if self.tree.is_chain:  # one node per depth, in depth order
            return state, request.target_cache, Proposal(tokens, self.tree.parents, valid, q=None)
        verify_index = jnp.zeros((B, D * Mm), jnp.int32).at[jnp.arange(B)[:, None], chosen].set(
            jnp.where(valid, jnp.arange(1, N + 1)[None], 0))
        depth_of = chosen // Mm
        parent_cell = (depth_of - 1) * Mm + jnp.take_along_axis(flat(parent), chosen, 1)
        parents = jnp.where(valid & (depth_of > 0),
                            jnp.take_along_axis(verify_index, jnp.clip(parent_cell, 0, D * Mm - 1), 1), 0)
        return state, request.target_cache, Proposal(tokens, parents.astype(jnp.int32), valid, q=None)
