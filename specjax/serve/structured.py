"""The server's structured output: a request's constraint (protocol.constraint) compiled into
a `specjax.Grammar` over the served tokenizer's vocabulary, once per distinct constraint
(the most recent `CACHED` kept), off the event loop (compiling a large vocabulary's
automaton takes seconds). The grammar's EOS is the server's first stop id.

It knows the grammar module and OpenAI's errors; nothing of HTTP routes or the engine's
thread.
"""

from __future__ import annotations

import collections
import json
import threading

from specjax.grammar import Grammar, GrammarError, Vocabulary
from specjax.serve.protocol import ApiError

CACHED = 64  # compiled grammars kept (vLLM caches them likewise)


class Constraints:
    """Compiles and caches the grammars of one server's requests."""

    def __init__(self, tokenizer, vocab_size: int, eos: int | None, capacity: tuple | None):
        self.tokenizer, self.vocab_size, self.eos, self.capacity = tokenizer, vocab_size, eos, capacity
        self._vocabulary: Vocabulary | None = None
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def grammar(self, constraint) -> Grammar | None:
        """The Grammar of `protocol.constraint`'s answer (None: none), or an ApiError naming
        the field: the engine holds none, or the library cannot compile it (its reason)."""
        if constraint is None:
            return None
        kind, spec, whitespace, param = constraint
        if self.capacity is None:
            raise ApiError(400, f"{param}: this server holds no grammars (started with --max-grammar-states 0)",
                           param=param, code="unsupported_parameter")
        if self.eos is None:
            raise ApiError(400, f"{param}: the server knows no EOS id to end a constrained reply with", param=param)
        key = (kind, json.dumps(spec, sort_keys=True), whitespace)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            if self._vocabulary is None:
                self._vocabulary = Vocabulary.of(self.tokenizer, self.vocab_size, self.eos)
        try:
            if kind == "regex":
                grammar = Grammar.regex(spec, self._vocabulary)
            elif kind == "choice":
                grammar = Grammar.choice(spec, self._vocabulary)
            else:
                grammar = Grammar.json_schema(spec, self._vocabulary, whitespace)
        except GrammarError as e:
            raise ApiError(400, f"{param}: {e}", param=param, code="invalid_value") from None
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHED:
                self._cache.popitem(last=False)
        return grammar
