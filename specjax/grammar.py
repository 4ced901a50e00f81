"""Structured output: a regex (or a JSON schema or a list of choices, turned into one) compiled
into a token-level finite automaton, held on the device as arrays and walked inside the
compiled step.

`Grammar` is one constraint compiled on the host by outlines-core for a `Vocabulary` (the
tokenizer's token texts): its states, the tokens each allows, and where each leads. Why
outlines-core: it turns a regex over a vocabulary into a *finite* automaton of tokens, which
fits fixed-shape arrays, so every draft position of a chain or a tree is masked by the state
its path reaches with no host round trip; xgrammar and llguidance match context-free
grammars with a pushdown stack the host advances token by token, which each speculative
step would wait on for every path of every row. The price: a JSON schema must be one a
regex can express (outlines-core's `build_regex_from_schema`: no unbounded recursion).

`Automaton` is a grammar per row on the device: tokens in classes (those that move alike in
every state), per state a bitmask of the allowed tokens (one of the grammar's distinct
masks, [M, V/32] uint32), the state they lead to, and the classes that lead elsewhere in
compressed rows (per state their classes, increasing, and targets), found by a fixed number
of bisection steps (`step`); an engine holds one of fixed capacity per slot (`Capacity`),
written at admission like the rest of a row. A row's state is an int32: FREE (no grammar:
everything allowed, it stays FREE), a state of the automaton, or DEAD (a draft token its
state did not allow: everything allowed, since the target gives that token probability 0
and nothing is ever drawn from a dead node's distribution).

It knows tokenizers' texts, outlines-core and arrays; nothing of models, drafters or loops.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

FREE, DEAD = -1, -2  # a row's state without a grammar; after a token its state did not allow


class GrammarError(ValueError):
    """A constraint that cannot be compiled (the library's reason), or is too large."""


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """The token texts a grammar is compiled over: outlines-core's vocabulary (each text's
    ids; special tokens and ids without text left out, so never allowed) and the model's
    vocabulary size (ids past the tokenizer's are never allowed), eos: the id allowed where
    the constraint is complete (it stops the row)."""

    index_vocabulary: object  # outlines_core.Vocabulary
    vocab_size: int
    eos: int

    @classmethod
    def from_texts(cls, texts: dict[int, str | bytes], eos: int, vocab_size: int) -> "Vocabulary":
        """From {token id: its text} (tests and tokenizers alike)."""
        from outlines_core import Vocabulary as IndexVocabulary

        by_text: dict[bytes, list[int]] = {}
        for token, text in texts.items():
            data = text.encode() if isinstance(text, str) else bytes(text)
            if data and token != eos and 0 <= token < vocab_size:
                by_text.setdefault(data, []).append(int(token))
        return cls(IndexVocabulary(int(eos), by_text), int(vocab_size), int(eos))

    @classmethod
    def of(cls, tokenizer, vocab_size: int, eos: int | None = None) -> "Vocabulary":
        """A transformers tokenizer's: each token's bytes (byte-level BPE's through GPT-2's byte
        map, SentencePiece's ▁ as a space and <0xNN> as its byte), special tokens left out;
        eos: default the tokenizer's."""
        eos = tokenizer.eos_token_id if eos is None else eos
        if eos is None:
            raise GrammarError("the tokenizer names no EOS token: give the id that ends a constrained reply")
        return cls.from_texts(cls.texts(tokenizer), eos, vocab_size)

    @staticmethod
    def texts(tokenizer) -> dict[int, bytes]:
        """{token id: its bytes} of a transformers tokenizer, special tokens left out (`of`'s
        input to `from_texts`)."""
        special = set(tokenizer.all_special_ids)
        return {i: _token_bytes(tokenizer, token) for token, i in tokenizer.get_vocab().items() if i not in special}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet back to bytes."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    rest = [b for b in range(256) if b not in bs]  # mapped to 256, 257, ... in order
    return {chr(c): b for b, c in zip(bs + rest, bs + [256 + i for i in range(len(rest))])}


_BYTES = _byte_decoder()
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _token_bytes(tokenizer, token: str) -> bytes:
    """One vocabulary entry's bytes, as the tokenizer's decoder would produce them in a text."""
    byte = _BYTE_TOKEN.match(token)
    if byte:
        return bytes([int(byte.group(1), 16)])
    if "▁" in token:  # SentencePiece
        return token.replace("▁", " ").encode()
    if all(c in _BYTES for c in token):  # byte-level BPE
        return bytes(_BYTES[c] for c in token)
    return tokenizer.convert_tokens_to_string([token]).encode()


MAX_GRAMMAR_BYTES = 256 << 20  # a grammar's arrays on the device, at most


class Capacity(NamedTuple):
    """What one row's automaton holds (an engine's slot: `Engine(max_grammar_states=,
    max_grammar_masks=, max_grammar_edges=)`): states, distinct token masks, exceptional moves."""

    states: int
    masks: int
    edges: int

    def bytes(self, vocab_size: int) -> int:
        """A row's arrays at this capacity: per state its default, mask and start (12 bytes),
        per mask V/8 bytes, per move 8 bytes, and each token's class (4 bytes a token)."""
        W = -(-vocab_size // 32)
        return 12 * self.states + 4 + 4 * W * self.masks + 8 * self.edges + 4 * 32 * W

    def refusal(self, source: str, states: int, masks: int = 0, edges: int = 0, names=None) -> str | None:
        """Why a grammar of these sizes does not fit (None: it does), naming how to hold more:
        names: the three settings (default `Engine`'s arguments, `ENGINE_NAMES`; a server's
        flags). masks and edges 0: not yet counted (states are counted first)."""
        over = [(most, what, name) for have, most, what, name in
                zip((states, masks, edges), self, ("states", "token masks", "exceptional moves"), names or ENGINE_NAMES)
                if have > most]
        if not over:
            return None
        sizes = f"{states} states" + (f", {masks} distinct token masks and {edges} exceptional moves" if masks else "")
        return f"{source} compiles to {sizes}; a row holds " + ", ".join(f"{m} {w} ({n})" for m, w, n in over)


ENGINE_NAMES = ("Engine(max_grammar_states=...)", "Engine(max_grammar_masks=...)", "Engine(max_grammar_edges=...)")


@dataclass(frozen=True, eq=False)
class Grammar:
    """One constraint compiled on the host: states 0..Q-1 (`initial` the start), and tokens in
    classes (token_class int32 [W*32], W = ceil(V/32)): tokens that every state allows alike
    and sends to the same state share one (class 0: tokens no state allows). Per state its
    allowed tokens as bits (masks uint32 [M, W] the distinct sets, mask int32 [Q] each state's
    row of them), the state most of its allowed classes lead to (default int32 [Q]), and the
    other classes as exceptions (starts int32 [Q+1]; classes, targets int32 [E], increasing
    classes within a state). In a JSON string of bounded length a state's tokens lead to as
    many states as there are token lengths, and states differ little in what they allow:
    moves by class and distinct masks hold that in a few classes a state and a few masks,
    where moves by token took most of the vocabulary a state, and a mask each state."""

    masks: np.ndarray
    mask: np.ndarray
    token_class: np.ndarray
    default: np.ndarray
    starts: np.ndarray
    classes: np.ndarray
    targets: np.ndarray
    initial: int
    finals: frozenset
    source: str  # what it was compiled from, for messages

    @classmethod
    def regex(cls, pattern: str, vocabulary: Vocabulary, source: str | None = None,
              capacity: Capacity | None = None, names=None) -> "Grammar":
        """The constraint that the reply's text matches `pattern` (a whole match), then EOS.
        capacity: refused (GrammarError, `Capacity.refusal` naming `names`) where it does not
        fit, its states counted before anything else is built, its masks and moves before
        any mask is (an engine's rows hold so many)."""
        from outlines_core import Index

        if not isinstance(pattern, str):
            raise GrammarError(f"a regex must be a string, got {type(pattern).__name__}")
        source = source or f"the regex {pattern[:80]!r}"
        try:
            index = Index(pattern, vocabulary.index_vocabulary)
        except Exception as e:  # noqa: BLE001 - the library's own reason, named
            raise GrammarError(f"{source} cannot be compiled: {' '.join(str(e).split())[:300]}") from None
        moves = index.get_transitions()  # {state: {token: next state}}
        states = np.array(sorted(set(moves) | {t for edges in moves.values() for t in edges.values()}), np.int64)
        Q, V = len(states), vocabulary.vocab_size
        W = -(-V // 32)
        if capacity is not None and Q > capacity.states:
            raise GrammarError(capacity.refusal(source, Q, names=names))

        def moves_of(s):  # (tokens, next states) int64 of state s's moves, the model's tokens only
            edges = moves.get(s) or {}
            t = np.fromiter(edges.keys(), np.int64, len(edges))
            n = np.searchsorted(states, np.fromiter(edges.values(), np.int64, len(edges)))
            return t[t < V], n[t < V]

        # Token classes by refinement, a state at a time: tokens alike so far that this state
        # sends apart (or allows one and not the other) part; what is left of a class keeps it.
        token_class = np.zeros(32 * W, np.int64)  # 0: allowed nowhere (so far)
        fresh = 1
        for s in states:
            t, n = moves_of(s)
            pairs, inverse = np.unique(token_class[t] * Q + n, return_inverse=True)
            token_class[t] = fresh + inverse
            fresh += len(pairs)
        kinds, first, token_class = np.unique(token_class, return_index=True, return_inverse=True)
        held = np.flatnonzero(kinds != 0)  # classes numbered 1, 2, ... by their first token (0 stays 0)
        number = np.zeros(len(kinds), np.int64)
        number[held[np.argsort(first[held])]] = np.arange(1, len(held) + 1)
        token_class = number[token_class.reshape(-1)].astype(np.int32)
        # Per state: its classes, each one's next state, the default (the one most classes lead
        # to; the smallest of a tie), the others as exceptions, and its set of classes' mask.
        default, mask = np.zeros(Q, np.int32), np.zeros(Q, np.int32)
        starts, classes, targets, sets = [0], [], [], {}
        for i, s in enumerate(states):
            t, n = moves_of(s)
            c, at = np.unique(token_class[t], return_index=True)
            n = n[at]
            if len(n):
                counts = np.bincount(n)
                default[i] = counts.argmax()
                classes.append(c[n != default[i]])
                targets.append(n[n != default[i]])
                starts.append(starts[-1] + len(classes[-1]))
            else:
                starts.append(starts[-1])
            mask[i] = sets.setdefault(c.astype(np.int32).tobytes(), len(sets))
        M, E = len(sets), starts[-1]
        why = capacity and capacity.refusal(source, Q, M, E, names)
        if why:
            raise GrammarError(why)
        if M * W * 4 > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"{source} compiles to {M} distinct token masks over {V} tokens: "
                               f"{M * W * 4 / 2**20:.0f} MiB, over the {MAX_GRAMMAR_BYTES >> 20} MiB allowed")
        masks = np.zeros((M, W), np.uint32)
        member = np.zeros(len(held) + 1, bool)
        for row, key in enumerate(sets):
            member[:] = False
            member[np.frombuffer(key, np.int32)] = True
            masks[row] = np.packbits(member[token_class], bitorder="little").view("<u4")
        join = lambda parts: np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)  # noqa: E731
        return cls(masks, mask, token_class, default, np.array(starts, np.int32), join(classes), join(targets),
                   int(np.searchsorted(states, index.get_initial_state())),
                   frozenset(int(i) for i in np.searchsorted(states, sorted(index.get_final_states()))), source)

    @classmethod
    def choice(cls, choices, vocabulary: Vocabulary, capacity: Capacity | None = None, names=None) -> "Grammar":
        """The reply is one of `choices` (strings), exactly (vLLM's guided_choice)."""
        if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError("a choice constraint is a non-empty list of strings")
        return cls.regex("(" + "|".join(re.escape(c) for c in choices) + ")", vocabulary,
                         f"the choice among {len(choices)} strings", capacity, names)

    @classmethod
    def json_schema(cls, schema, vocabulary: Vocabulary, whitespace: str | None = None,
                    capacity: Capacity | None = None, names=None) -> "Grammar":
        """The reply is JSON that validates against `schema` (a dict, or its JSON text), as
        outlines-core's regex for it says (whitespace: a regex, default theirs). A keyword
        that regex does not express (outlines-core passes over `maximum`, `multipleOf`,
        `uniqueItems`, ...: `UNEXPRESSED`) is refused, named by its path, rather than
        letting through output that would not validate."""
        from outlines_core.json_schema import build_regex_from_schema

        try:
            parsed = json.loads(schema) if isinstance(schema, str) else schema
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not JSON: {e}") from None
        _check_expressed(parsed, "")
        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            pattern = build_regex_from_schema(text, whitespace)
        except Exception as e:  # noqa: BLE001 - the library's reason names the part it cannot express
            raise GrammarError(f"the JSON schema cannot be compiled: {' '.join(str(e).split())[:300]}") from None
        return cls.regex(pattern, vocabulary, "the JSON schema", capacity, names)

    @property
    def num_states(self) -> int:
        return self.starts.shape[0] - 1

    def state_after(self, tokens) -> int:
        """The state after `tokens` (ids) from the start, walked on the host (a preempted
        request resumes there): DEAD once one was not allowed."""
        state = self.initial
        for token in tokens:
            known = 0 <= token < self.masks.shape[1] * 32
            if not known or not (self.masks[self.mask[state], token // 32] >> (token % 32)) & 1:
                return DEAD
            lo, hi = self.starts[state], self.starts[state + 1]
            c = self.token_class[token]
            at = lo + int(np.searchsorted(self.classes[lo:hi], c))
            state = int(self.targets[at]) if at < hi and self.classes[at] == c else int(self.default[state])
        return state

    @property
    def num_masks(self) -> int:
        return self.masks.shape[0]

    @property
    def num_edges(self) -> int:
        return self.classes.shape[0]

    @property
    def vocab_ids(self) -> int:
        """The ids its masks cover (its vocabulary's size, rounded up to 32)."""
        return self.masks.shape[1] * 32


# JSON Schema keywords outlines-core's regex does not express (it passes over them, so output
# would match the regex and still fail the schema): refused by `Grammar.json_schema`.
UNEXPRESSED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems",
               "minProperties", "maxProperties", "not", "if", "then", "else", "dependentRequired",
               "dependentSchemas", "dependencies", "patternProperties", "propertyNames", "contains", "minContains",
               "maxContains", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMAS = ("items", "additionalProperties", "additionalItems")  # a schema each
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # a list of schemas each
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # name -> schema


def _check_expressed(schema, path: str):
    """GrammarError naming the first keyword of `UNEXPRESSED` in a schema and its subschemas."""
    if isinstance(schema, list):  # (items as a list of schemas)
        for i, s in enumerate(schema):
            _check_expressed(s, f"{path}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    for key in UNEXPRESSED:
        if key in schema:
            raise GrammarError(f"the JSON schema's {path + '.' if path else ''}{key} is not supported: outlines-core's "
                               f"regex does not express it, so output could fail the schema")
    for key in _SUBSCHEMAS:
        if key in schema:
            _check_expressed(schema[key], f"{path + '.' if path else ''}{key}")
    for key in _SCHEMA_LISTS:
        for i, s in enumerate(schema.get(key) or ()):
            _check_expressed(s, f"{path + '.' if path else ''}{key}[{i}]")
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, s in schema[key].items():
                _check_expressed(s, f"{path + '.' if path else ''}{key}.{name}")


@struct.dataclass
class Automaton:
    """One grammar per row on the device (its own states, masks, classes and exceptions,
    padded to the batch's largest, or to an engine's capacity: `of`); a row's state indexes
    its own."""

    masks: jax.Array  # uint32 [B, M, W]: bit v % 32 of word v // 32: token v is allowed by that mask
    mask: jax.Array  # int32 [B, Q]: each state's mask
    token_class: jax.Array  # int32 [B, W*32]: each token's class (`Grammar`)
    default: jax.Array  # int32 [B, Q]: where an allowed token leads unless an exception says otherwise
    starts: jax.Array  # int32 [B, Q+1]: state q's exceptions are starts[q] .. starts[q+1] - 1
    classes: jax.Array  # int32 [B, E]: each exception's class, increasing within a state
    targets: jax.Array  # int32 [B, E]: the state its tokens lead to

    AXES = {"masks": ("batch", None, None), "mask": ("batch", None), "token_class": ("batch", None),
            "default": ("batch", None), "starts": ("batch", None), "classes": ("batch", None),
            "targets": ("batch", None)}  # sharding.declared_axes: rows over data

    @staticmethod
    def arrays(grammars, vocab_size: int, capacity: Capacity | None = None) -> tuple:
        """Host arrays of an `Automaton` for rows of these grammars (None: a free row) and each
        row's initial state int32 [B] (FREE for None): padded to `capacity` (default the
        largest of each, rounded up to a power of two so that similar grammars share programs)."""
        held = [g for g in grammars if g is not None]
        for g in held:
            if g.vocab_ids < vocab_size:
                raise GrammarError(f"{g.source} was compiled for a smaller vocabulary than the model's {vocab_size}")
        if capacity is None:
            capacity = Capacity(*(1 << max([size(g) - 1 for g in held] + [0]).bit_length() for size in
                                  (lambda g: g.num_states, lambda g: g.num_masks, lambda g: g.num_edges)))
        for g in held:
            why = capacity.refusal(g.source, g.num_states, g.num_masks, g.num_edges)
            if why:
                raise GrammarError(why)
        out = Automaton._zeros(np, len(grammars), vocab_size, capacity)
        W = out[0].shape[2]  # words of a mask
        for b, g in enumerate(grammars):
            if g is not None:
                n, m, e = g.num_states, g.num_masks, g.num_edges
                out[0][b, :m], out[1][b, :n], out[2][b] = g.masks[:, :W], g.mask, g.token_class[:W * 32]
                out[3][b, :n], out[4][b, :n + 1], out[4][b, n + 1:] = g.default, g.starts, e
                out[5][b, :e], out[6][b, :e] = g.classes, g.targets
        initial = np.array([FREE if g is None else g.initial for g in grammars], np.int32)
        return out, initial

    @staticmethod
    def _zeros(xp, rows: int, vocab_size: int, capacity: Capacity) -> tuple:
        """The fields' arrays for `rows` free rows at capacity, all zeros, of xp (numpy on the
        host, jax.numpy in a program)."""
        W = -(-vocab_size // 32)
        Q, M, E = capacity
        return (xp.zeros((rows, M, W), np.uint32), xp.zeros((rows, Q), np.int32), xp.zeros((rows, W * 32), np.int32),
                xp.zeros((rows, Q), np.int32), xp.zeros((rows, Q + 1), np.int32), xp.zeros((rows, E), np.int32),
                xp.zeros((rows, E), np.int32))

    @classmethod
    def free(cls, rows: int, vocab_size: int, capacity: Capacity) -> "Automaton":
        """An automaton of `rows` free rows at capacity: zeros, built in the program (an
        engine's empty state: nothing as large is made on the host)."""
        return cls(*cls._zeros(jnp, rows, vocab_size, capacity))

    @classmethod
    def resumed(cls, rows, vocab_size: int, capacity: Capacity) -> tuple["Automaton", np.ndarray]:
        """(host arrays of an Automaton at capacity, each row's state) for rows of (a Grammar
        or None, the tokens it has emitted so far): a resumed row (an engine's preempted
        request) starts where its output left it."""
        arrays, states = cls.arrays([g for g, _ in rows], vocab_size, capacity)
        for i, (g, emitted) in enumerate(rows):
            if g is not None:
                states[i] = g.state_after(emitted)
        return cls(*arrays), states

    @classmethod
    def of(cls, grammars, vocab_size: int) -> tuple["Automaton", np.ndarray]:
        """(the automaton of these rows' grammars, each row's initial state): `arrays` on the device."""
        arrays, initial = cls.arrays(grammars, vocab_size)
        return cls(*(jnp.asarray(x) for x in arrays)), initial

    @property
    def vocab_size(self) -> int:
        return self.masks.shape[-1] * 32

    def _bit(self, rows, state, token):
        words = self.masks[rows, self.mask[rows, jnp.maximum(state, 0)], token // 32]
        return ((words >> (token % 32).astype(jnp.uint32)) & 1) == 1

    def step(self, state: jax.Array, token: jax.Array) -> jax.Array:
        """int32 [B, ...]: each row's states after `token` int32 [B, ...] in `state` int32 [B,
        ...] (FREE and DEAD stay; a token the state does not allow: DEAD). The token's class's
        exception is found by a bisection of the state's in ceil(log2(E + 1)) fixed steps."""
        B, E = self.classes.shape
        state, token = jnp.broadcast_arrays(state, token)
        rows = jnp.arange(B).reshape((B,) + (1,) * (state.ndim - 1))
        q = jnp.maximum(state, 0)
        known = jnp.clip(token, 0, self.vocab_size - 1)
        kind = self.token_class[rows, known]
        lo, end = self.starts[rows, q], self.starts[rows, q + 1]

        def halve(_, bounds):
            lo, hi = bounds
            mid = (lo + hi) // 2
            right = self.classes[rows, jnp.minimum(mid, E - 1)] < kind
            going = lo < hi
            return jnp.where(going & right, mid + 1, lo), jnp.where(going & ~right, mid, hi)

        if E:
            lo, _ = jax.lax.fori_loop(0, math.ceil(math.log2(E + 1)), halve, (lo, end))
        at = jnp.minimum(lo, max(E - 1, 0))
        found = (lo < end) & (self.classes[rows, at] == kind) if E else jnp.zeros(state.shape, bool)
        moved = jnp.where(found, self.targets[rows, at] if E else 0, self.default[rows, q])
        token_ok = (token >= 0) & (token < self.vocab_size)
        allowed = self._bit(rows, state, known) & token_ok
        return jnp.where(state < 0, state, jnp.where(allowed, moved, DEAD))

    def allows(self, state: jax.Array, vocab_size: int) -> jax.Array:
        """bool [B, ..., vocab_size]: the tokens each of `state` int32 [B, ...] allows (FREE
        and DEAD: all)."""
        B = state.shape[0]
        rows = jnp.arange(B).reshape((B,) + (1,) * (state.ndim - 1))
        words = self.masks[rows, self.mask[rows, jnp.maximum(state, 0)]]  # [B, ..., W]
        # Each word's 32 bits by a broadcast shift, not a gather over the vocabulary: on a TPU
        # that gather's [V, B] layout pads B to 128 lanes (16x a row's mask at 8 rows).
        bits = (words[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1  # [B, ..., W, 32]
        bits = bits.reshape(*words.shape[:-1], -1)[..., :vocab_size]
        return (bits == 1) | (state < 0)[..., None]

    def walk(self, state: jax.Array, tokens: jax.Array, parents, depth: int) -> jax.Array:
        """int32 [B, N+1]: the state each node of a token tree reaches (node 0, the root, is in
        `state` int32 [B]; node i is tokens[:, i-1], its parent parents[i-1] (numpy [N] or
        int32 [B, N]), after its ancestors' tokens): depth passes, each node taking its
        parent's state of the pass before (every node deeper than the pass is wrong until
        the pass of its depth)."""
        B, N = tokens.shape
        parents = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (B, N))
        states = jnp.broadcast_to(state[:, None], (B, N + 1))
        for _ in range(depth):
            states = jnp.concatenate(
                [state[:, None], self.step(jnp.take_along_axis(states, parents, axis=1), tokens)], axis=1)
        return states

    def run(self, state: jax.Array, tokens: jax.Array, count: jax.Array) -> jax.Array:
        """int32 [B]: each row's state after its first count[b] of tokens int32 [B, T]."""
        for j in range(tokens.shape[1]):
            state = jnp.where(j < count, self.step(state, tokens[:, j]), state)
        return state
