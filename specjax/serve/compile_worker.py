"""The server's structured-output constraints compiled into `specjax.Grammar`s in a process
of its own (`specjax.compile_process.Compiler`), so that a compile can be stopped: one that
outlasts its time is killed with the process (a thread cannot be), and one that needs more
memory than the process may add is refused and the process ended; either way the next
compile starts a new process. outlines-core builds a regex's whole index before its states
can be counted, so these two limits are what bound the work a request can ask.

A start imports specjax (about 2 s) and builds the vocabulary, once, outside any compile's
time. Compiles arrive one at a time (the caller's single thread).

It knows the grammar module and the compiling process; nothing of HTTP or the engine.
"""

from __future__ import annotations

import os

from specjax.compile_process import Compiler
from specjax.grammar import Capacity, Grammar, GrammarError, Vocabulary

MEMORY_BYTES = 4 << 30  # the address space a compile may add to the process's own at its start


class CompileTimeout(Exception):
    """A compile ran past its time; its process was killed."""


class CompileWorker:
    """Compiles one constraint at a time in a child process: `compile` returns the Grammar or
    raises GrammarError (the library's reason, a limit, or the process's end) or
    CompileTimeout."""

    def __init__(self, texts: dict, eos: int, vocab_size: int, memory: int = MEMORY_BYTES):
        self.memory = memory
        self._compiler = Compiler(_prepare, (texts, eos, vocab_size, memory), limit=0.0)
        self.starts = 0  # processes started (tests)

    def compile(self, kind: str, spec, whitespace: str | None, capacity: Capacity, timeout: float,
                names=None) -> Grammar:
        """The Grammar (refused where it does not fit `capacity`, `Capacity.refusal` naming
        `names`), or GrammarError, or CompileTimeout."""
        compiler = self._compiler
        self.start()
        compiler.limit = timeout
        try:
            outcome = compiler.compile(kind, spec, whitespace, tuple(capacity), names)
        except ValueError as e:  # (a GrammarError in the child)
            if str(e).startswith(_MEMORY):
                compiler.close()  # (what the failed compile left is not trusted)
            raise GrammarError(str(e)) from None
        except ChildProcessError as e:
            compiler.close()
            raise GrammarError(f"its compile ended the compiling process ({str(e).splitlines()[0]}): it may need "
                               f"more than the {self.memory >> 20} MiB of memory a compile may take") from None
        if outcome.stopped:
            raise CompileTimeout
        return outcome.value

    def start(self):
        """Starts the process if none runs (imports and the vocabulary, outside any compile's
        time); a compile starts it too."""
        if self._compiler.pid is None:
            self.starts += 1
            try:
                self._compiler.start()
            except ChildProcessError as e:
                raise GrammarError(f"the grammar compiler did not start: {e}") from None

    @property
    def pid(self) -> int | None:
        return self._compiler.pid

    def kill(self):
        """Ends the process now, from any thread (a compile waiting on it sees it end)."""
        self._compiler.kill()


_MEMORY = "compiling it needs more than"


def _prepare(setup):
    """In the child: the vocabulary and the memory limit; then each job (kind, spec,
    whitespace, capacity, names) named and compiled."""
    texts, eos, vocab_size, memory = setup
    vocabulary = Vocabulary.from_texts(texts, eos, vocab_size)
    _limit_memory(memory)

    def handler(kind, spec, whitespace, capacity, names):
        def run():
            try:
                if kind == "regex":
                    return Grammar.regex(spec, vocabulary, capacity=Capacity(*capacity), names=names)
                if kind == "choice":
                    return Grammar.choice(spec, vocabulary, Capacity(*capacity), names)
                return Grammar.json_schema(spec, vocabulary, whitespace, Capacity(*capacity), names)
            except MemoryError:
                raise GrammarError(f"{_MEMORY} the {memory >> 20} MiB of memory a compile may take") from None

        return f"the {kind} constraint", run

    return None, handler


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
