"""A process of its own in which the server compiles constraints into `specjax.Grammar`s, so
that a compile can be stopped: one that outlasts its time is killed with the process (a
thread cannot be), and one that needs more memory than the process may add ends it; either
way the next compile starts a new process. outlines-core builds a regex's whole index before
its states can be counted, so these two limits are what bound the work a request can ask.

Spawned, not forked (the server's threads, JAX's among them, are not copied): a start
imports specjax (about 2 s) and builds the vocabulary, once, outside any compile's time.
Compiles arrive one at a time (the caller's single thread).

It knows the grammar module and processes; nothing of HTTP or the engine.
"""

from __future__ import annotations

import multiprocessing
import os

from specjax.grammar import Capacity, Grammar, GrammarError, Vocabulary

START_SECONDS = 300.0  # the longest a start (imports, the vocabulary) may take
MEMORY_BYTES = 4 << 30  # the address space a compile may add to the process's own at its start


class CompileTimeout(Exception):
    """A compile ran past its time; its process was killed."""


class CompileWorker:
    """Compiles one constraint at a time in a child process: `compile` returns the Grammar or
    raises GrammarError (the library's reason, a limit, or the process's end) or
    CompileTimeout."""

    def __init__(self, texts: dict, eos: int, vocab_size: int, memory: int = MEMORY_BYTES):
        self._args = (texts, eos, vocab_size, memory)
        self.memory = memory
        self._process = self._connection = None
        self.starts = 0  # processes started (tests)

    def compile(self, kind: str, spec, whitespace: str | None, capacity: Capacity, timeout: float,
                names=None) -> Grammar:
        """The Grammar (refused where it does not fit `capacity`, `Capacity.refusal` naming
        `names`), or GrammarError, or CompileTimeout."""
        if self._process is None or not self._process.is_alive():
            self._start()
        self._connection.send((kind, spec, whitespace, tuple(capacity), names))
        if not self._connection.poll(timeout):
            self.close()
            raise CompileTimeout
        try:
            ok, value, ends = self._connection.recv()
        except EOFError:
            self._process.join()
            code = self._process.exitcode
            self.close()
            raise GrammarError(f"its compile ended the compiling process (exit code {code}): it may need more than "
                               f"the {self.memory >> 20} MiB of memory a compile may take") from None
        if ends:
            self.close()
        if not ok:
            raise GrammarError(value)
        return value

    def _start(self):
        self.close()
        context = multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, *self._args), name="specjax-grammar",
                                        daemon=True)
        self._process.start()
        child.close()
        self.starts += 1
        if not self._connection.poll(START_SECONDS):
            self.close()
            raise GrammarError(f"the grammar compiler did not start within {START_SECONDS:.0f} s")
        try:
            self._connection.recv()  # "ready"
        except EOFError:
            self.close()
            raise GrammarError("the grammar compiler's process ended as it started") from None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def kill(self):
        """Ends the process now, from any thread (a compile waiting on it sees it end)."""
        process = self._process
        if process is not None:
            process.kill()

    def close(self):
        """Ends the process (a compile in it with it); from the thread that compiles."""
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._connection.close()
        self._process = self._connection = None


def _serve(connection, texts: dict, eos: int, vocab_size: int, memory: int):
    """The child: the vocabulary, its memory limit, then one compile per message until the
    pipe closes; each answered (ok, the Grammar or why not, whether the process ends)."""
    vocabulary = Vocabulary.from_texts(texts, eos, vocab_size)
    _limit_memory(memory)
    connection.send("ready")
    while True:
        try:
            kind, spec, whitespace, capacity, names = connection.recv()
        except EOFError:
            return
        capacity = Capacity(*capacity)
        try:
            if kind == "regex":
                grammar = Grammar.regex(spec, vocabulary, capacity=capacity, names=names)
            elif kind == "choice":
                grammar = Grammar.choice(spec, vocabulary, capacity, names)
            else:
                grammar = Grammar.json_schema(spec, vocabulary, whitespace, capacity, names)
        except GrammarError as e:
            connection.send((False, str(e), False))
        except MemoryError:  # (then the process ends: what the failed compile left is not trusted)
            connection.send((False, f"compiling it needs more than the {memory >> 20} MiB of memory a compile may "
                                    f"take", True))
            return
        else:
            connection.send((True, grammar, False))


def _limit_memory(memory: int):
    """The process's address space capped at its present size plus `memory` (Linux; elsewhere
    the time limit alone bounds a compile)."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            present = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = present + memory if hard == resource.RLIM_INFINITY else min(present + memory, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, ValueError):
        pass
