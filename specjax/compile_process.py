"""Compiles programs one at a time in a process of its own, so that a compile can be stopped:
XLA compiles in native code, which heeds no signal until it returns (Ctrl-C waits for it) and
which no thread can stop, so a compile that outlasts its limit, or one that the user
interrupts, ends with the process. The next compile after a stopped one starts a new process.

The child is spawned, not forked (the parent's threads, JAX's among them, are not copied),
with Ctrl-C ignored: the parent, which Ctrl-C interrupts at once, kills it. It ends itself when
the parent dies without killing it (a SIGTERM). It runs JAX on the parent's platforms
(`jax_platforms`, which `specjax.cli` may have set to the CPU).

It knows processes and time; what is compiled, and how, is the caller's (`prepare`): XLA's
programs for `specjax plan --serve` (tools/serve_plan.py), structured output's grammars for
`specjax serve` (serve/compile_worker.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import threading
import time
import traceback
from typing import Any, Callable

START_SECONDS = 120.0  # the longest a process's start (imports, `prepare`) may take


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One compile: its program's name, what the child's job returned (None when stopped)."""

    name: str
    seconds: float  # from its start to its answer, or to its stop
    value: Any = None
    stopped: bool = False


class Compiler:
    """Jobs run one at a time in a child process: `prepare(setup)` runs there once a process
    and returns (info, handler); handler(*job) returns (a program's name, a function that
    compiles it and returns what the parent gets). `compile(*job)` answers an `Outcome`,
    stopped (the process killed) when its function runs past `limit` seconds; an error there
    is raised here (a ValueError as one, anything else as a ChildProcessError with its
    traceback). log(line): a line before and after each compile ("compiling 2 of 3: NAME")."""

    def __init__(self, prepare: Callable, setup, limit: float, log: Callable[[str], None] | None = None,
                 total: int | None = None):
        self._prepare, self._setup, self.limit = prepare, setup, limit
        self._log, self._total = log or (lambda line: None), total
        self._process = self._connection = None
        self.info = None  # what `prepare` returned
        self.count = 0  # compiles started

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self):
        """Starts the process (if none runs) and answers `prepare`'s info."""
        if self._process is None:
            self._spawn()
            if not self._connection.poll(START_SECONDS):
                self.close()
                raise ChildProcessError(f"the compiling process did not start within {START_SECONDS:.0f} s")
            self.info = self._receive("its start")
        return self.info

    def compile(self, *job) -> Outcome:
        self.start()
        self._connection.send(job)
        name = self._receive("a program's build")
        self.count += 1
        of = "" if self._total is None else f" of {self._total}"
        self._log(f"compiling {self.count}{of}: {name} (at most {self.limit:g} s)")
        begun = time.monotonic()
        if not self._connection.poll(self.limit):
            self.close()
            self._log(f"stopped {self.count}{of} at {self.limit:g} s: {name}")
            return Outcome(name, time.monotonic() - begun, stopped=True)
        value = self._receive(name)
        seconds = time.monotonic() - begun
        self._log(f"compiled {self.count}{of} in {seconds:.1f} s")
        return Outcome(name, seconds, value)

    @property
    def pid(self) -> int | None:
        """The running process's, or None."""
        process = self._process
        return None if process is None else process.pid

    def kill(self):
        """Ends the process now, from any thread (a compile waiting on it sees it end)."""
        process = self._process
        if process is not None:
            process.kill()

    def close(self):
        """Ends the process, a compile in it with it."""
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._connection.close()
        self._process = self._connection = None

    def _spawn(self):
        import jax

        context = multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_serve, name="specjax-compile", daemon=True, args=(
            child, self._prepare, self._setup, os.getpid(), jax.config.jax_platforms))
        with _ctrl_c_ignored():  # (inherited: the child ignores it from its first instruction)
            self._process.start()
        child.close()

    def _receive(self, what: str):
        try:
            kind, value = self._connection.recv()
        except EOFError:
            self._process.join()
            code = self._process.exitcode
            self.close()
            raise ChildProcessError(f"the compiling process ended during {what} (exit code {code})") from None
        if kind == "value error":
            raise ValueError(value)
        if kind == "error":
            raise ChildProcessError(f"the compiling process failed:\n{value}")
        return value


@contextlib.contextmanager
def _ctrl_c_ignored():
    """SIGINT ignored meanwhile (from the main thread; a Ctrl-C in between is lost)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, held)


def _serve(connection, prepare: Callable, setup, parent: int, platforms: str | None):
    """The child: `prepare`, then one job a message until the pipe closes; every message
    answered (kind, value), a job's by its name first, then its value."""
    threading.Thread(target=_end_when_orphaned, args=(parent,), daemon=True).start()
    if platforms:
        import jax

        jax.config.update("jax_platforms", platforms)
    try:
        info, handler = prepare(setup)
    except Exception as e:  # noqa: BLE001 - the parent raises it
        connection.send(_failure(e))
        return
    connection.send(("ready", info))
    while True:
        try:
            job = connection.recv()
        except EOFError:
            return
        try:
            name, run = handler(*job)
            connection.send(("name", name))
            connection.send(("value", run()))
        except Exception as e:  # noqa: BLE001 - the parent raises it
            connection.send(_failure(e))


def _failure(e: Exception) -> tuple[str, str]:
    if isinstance(e, ValueError):
        return "value error", str(e)
    return "error", traceback.format_exc()


def _end_when_orphaned(parent: int):
    """Ends the process at once when its parent has gone (killed, or ended by a signal)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)
