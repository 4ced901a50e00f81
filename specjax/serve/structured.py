"""The server's structured output: a request's constraint (protocol.constraint) compiled into
a `specjax.Grammar` over the served tokenizer's vocabulary, once per distinct constraint
(the most recent `CACHED` kept; requests asking for one being compiled wait for that
compile), in a worker of its own (`WORKERS` threads, off the event loop and off asyncio's
shared pool: compiling a large vocabulary's automaton takes seconds). What a request may
make the server do is bounded before anything is built: the constraint's text
(`MAX_CONSTRAINT_CHARS`), the states its automaton may have (the engine's rows' capacity,
checked before any array is made), and the time its compile may take (`COMPILE_SECONDS`:
then a 400 naming the limit; a thread cannot be stopped, so the compile ends in its worker
and the constraint is refused at once from then on). The grammar's EOS is the server's
first stop id.

It knows the grammar module and OpenAI's errors; nothing of HTTP routes or the engine's
thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import threading

from specjax.grammar import Grammar, GrammarError, Vocabulary
from specjax.serve.protocol import ApiError

CACHED = 64  # compiled grammars kept (vLLM caches them likewise)
MAX_CONSTRAINT_CHARS = 32 << 10  # a regex, the choices joined, or a schema's JSON text, at most
COMPILE_SECONDS = 30.0  # the longest a request waits for its constraint's compile
WORKERS = 1  # compiles at once (each holds a core while it runs)


class Constraints:
    """Compiles and caches the grammars of one server's requests."""

    def __init__(self, tokenizer, vocab_size: int, eos: int | None, capacity: tuple | None,
                 timeout: float = COMPILE_SECONDS):
        self.tokenizer, self.vocab_size, self.eos, self.capacity = tokenizer, vocab_size, eos, capacity
        self.timeout = timeout
        self._vocabulary: Vocabulary | None = None
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._compiling: dict = {}  # key -> the Future of its compile in the worker
        self._slow: collections.OrderedDict = collections.OrderedDict()  # keys whose compile ran out of time
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="specjax-grammar")

    async def grammar(self, constraint) -> Grammar | None:
        """The Grammar of `protocol.constraint`'s answer (None: none), or an ApiError naming
        the field: the engine holds none, it is too long, too large for a row, takes too
        long to compile, or the library cannot compile it (its reason)."""
        if constraint is None:
            return None
        kind, spec, whitespace, param = constraint
        if self.capacity is None:
            raise ApiError(400, f"{param}: this server holds no grammars (started with --max-grammar-states 0)",
                           param=param, code="unsupported_parameter")
        if self.eos is None:
            raise ApiError(400, f"{param}: the server knows no EOS id to end a constrained reply with", param=param)
        text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise ApiError(400, f"{param}: {len(text)} characters, over the {MAX_CONSTRAINT_CHARS} this server "
                                f"compiles", param=param, code="invalid_value")
        key = (kind, text, whitespace)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            if key in self._slow:
                raise self._too_slow(param)
            future = self._compiling.get(key)
            if future is None:
                future = self._compiling[key] = self._pool.submit(self._compile, key, kind, spec, whitespace, param)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout)
        except asyncio.TimeoutError:
            with self._lock:
                self._slow[key] = None
                while len(self._slow) > CACHED:
                    self._slow.popitem(last=False)
            raise self._too_slow(param) from None

    def _too_slow(self, param: str) -> ApiError:
        return ApiError(400, f"{param}: compiling it takes longer than the {self.timeout:.0f} s this server allows",
                        param=param, code="invalid_value")

    def _compile(self, key, kind: str, spec, whitespace, param: str) -> Grammar:
        """In the worker: the grammar, cached; or an ApiError naming why not."""
        try:
            if self._vocabulary is None:  # (seconds, once; one worker: no other compile races it, and
                # the event loop, which takes the lock, is not held up meanwhile)
                self._vocabulary = Vocabulary.of(self.tokenizer, self.vocab_size, self.eos)
            states = self.capacity[0]
            try:
                if kind == "regex":
                    grammar = Grammar.regex(spec, self._vocabulary, max_states=states)
                elif kind == "choice":
                    grammar = Grammar.choice(spec, self._vocabulary, max_states=states)
                else:
                    grammar = Grammar.json_schema(spec, self._vocabulary, whitespace, max_states=states)
            except GrammarError as e:
                raise ApiError(400, f"{param}: {e}", param=param, code="invalid_value") from None
            with self._lock:
                self._cache[key] = grammar
                while len(self._cache) > CACHED:
                    self._cache.popitem(last=False)
            return grammar
        finally:
            with self._lock:
                self._compiling.pop(key, None)

    def close(self):
        """Stops taking compiles (one running ends in its worker)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
