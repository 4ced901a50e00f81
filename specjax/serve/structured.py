"""The server's structured output: a request's constraint (protocol.constraint) compiled into
a `specjax.Grammar` over the served tokenizer's vocabulary, once per distinct constraint
(the most recent `CACHED` kept; requests asking for one being compiled wait for that
compile; one refused is refused at once after), in a process of its own (`CompileWorker`:
compiling a large vocabulary's automaton takes seconds, and outlines-core cannot be stopped
from inside). What a request may make the server do is bounded: the constraint's text
(`MAX_CONSTRAINT_CHARS`), the time its compile may take (`COMPILE_SECONDS`: the process is
killed, and a 400 names the limit), the memory it may add (`compile_worker.MEMORY_BYTES`),
the states, token masks and exceptional moves its automaton may have (the engine's rows'
capacity, checked before any mask is made; a refusal names the server's flags), and the
distinct constraints waiting at once (`PENDING`: then a 503). The grammar's EOS is the
server's first stop id.

It knows the grammar module, the compile worker and OpenAI's errors; nothing of HTTP routes
or the engine's thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import threading

from specjax.grammar import Capacity, Grammar, GrammarError, Vocabulary
from specjax.serve.compile_worker import MEMORY_BYTES, CompileTimeout, CompileWorker
from specjax.serve.protocol import ApiError

CACHED = 64  # compiled grammars kept, and refused constraints remembered (vLLM caches them likewise)
MAX_CONSTRAINT_CHARS = 32 << 10  # a regex, the choices joined, or a schema's JSON text, at most
COMPILE_SECONDS = 30.0  # the longest one constraint's compile may run
PENDING = 8  # distinct constraints compiling or waiting to, at most
# How a server's rows come to hold more (`Capacity.refusal`): its flags, not the Engine's arguments.
FLAGS = ("--max-grammar-states", "--max-grammar-masks", "--max-grammar-edges")


class Constraints:
    """Compiles and caches the grammars of one server's requests."""

    def __init__(self, tokenizer, vocab_size: int, eos: int | None, capacity: Capacity | None,
                 timeout: float = COMPILE_SECONDS, memory: int = MEMORY_BYTES, names=FLAGS):
        """capacity: what the engine's rows hold (`Engine.limits.grammar`); a constraint that
        does not fit is refused naming `names` (the server's flags)."""
        self.tokenizer, self.vocab_size, self.eos, self.capacity = tokenizer, vocab_size, eos, capacity
        self.names = names
        self.timeout, self.memory = timeout, memory
        self.worker: CompileWorker | None = None  # started with the server, in the thread below
        self._cache: collections.OrderedDict = collections.OrderedDict()  # key -> Grammar
        self._refused: collections.OrderedDict = collections.OrderedDict()  # key -> why (a 400's reason)
        self._compiling: dict = {}  # key -> the Future of its compile
        self._lock = threading.Lock()
        # One thread drives the worker: compiles run one at a time, each holding a core.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specjax-grammar")
        if capacity is not None and eos is not None:  # (its ~2 s start, once, not a first request's)
            self._pool.submit(self._started)

    async def grammar(self, constraint) -> Grammar | None:
        """The Grammar of `protocol.constraint`'s answer (None: none), or an ApiError naming
        the field: the engine holds none, it is too long, too large for a row, takes too
        long or too much memory to compile, the library cannot compile it (its reason), or
        too many others are waiting (503)."""
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
            if key in self._refused:
                raise _refusal(param, self._refused[key])
            future = self._compiling.get(key)
            if future is None:
                if len(self._compiling) >= PENDING:
                    raise ApiError(503, f"{param}: {PENDING} constraints are being compiled or waiting to be; "
                                        f"retry later", param=param, headers={"Retry-After": "5"})
                future = self._compiling[key] = self._pool.submit(self._compile, key, kind, spec, whitespace, param)
        # (each compile ends within its time, so the wait is bounded by those ahead of it)
        return await asyncio.shield(asyncio.wrap_future(future))

    def _compile(self, key, kind: str, spec, whitespace, param: str) -> Grammar:
        """In the thread: the grammar, cached; or an ApiError naming why not, remembered."""
        try:
            try:
                grammar = self._started().compile(kind, spec, whitespace, self.capacity, self.timeout, self.names)
            except GrammarError as e:
                reason = str(e)
            except CompileTimeout:
                reason = f"compiling it takes longer than the {self.timeout:g} s this server allows"
            else:
                with self._lock:
                    self._cache[key] = grammar
                    while len(self._cache) > CACHED:
                        self._cache.popitem(last=False)
                return grammar
            with self._lock:
                self._refused[key] = reason
                while len(self._refused) > CACHED:
                    self._refused.popitem(last=False)
            raise _refusal(param, reason)
        finally:
            with self._lock:
                self._compiling.pop(key, None)

    def _started(self) -> CompileWorker:
        """In the thread: the worker, its process started (the vocabulary's texts: a second,
        once; a start that fails is tried again by the next compile)."""
        if self.worker is None:
            self.worker = CompileWorker(Vocabulary.texts(self.tokenizer), self.eos, self.vocab_size, self.memory)
        self.worker.start()
        return self.worker

    def close(self):
        """Stops taking compiles and ends the worker's process (a compile in it with it)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.worker is not None:
            self.worker.kill()


def _refusal(param: str, reason: str) -> ApiError:
    return ApiError(400, f"{param}: {reason}", param=param, code="invalid_value")
