"""`Warmup`: the prefills of several waiting requests at once (and their inserts), compiled
in a background thread after the rest (`Engine.compile_all(groups_later=True)`), so that an
engine can serve sooner; until a (group size, bucket)'s programs are compiled, its requests
go in the sizes that are.

It knows a `Programs` and a thread; nothing of requests or the device's state (engine.py).
"""

from __future__ import annotations

import atexit
import threading
import weakref

_RUNNING = weakref.WeakSet()  # warmups whose thread may still run


@atexit.register
def _stop_all():
    """At interpreter exit a thread still inside XLA's compiler aborts the process (SIGABRT:
    "terminate called after throwing an instance of ''"): each background compile stops
    after the program it is compiling, and is waited for."""
    for warmup in list(_RUNNING):
        warmup.stop()


class Warmup:
    """One engine's background compile: `pending` the (n, bucket) groups not compiled yet,
    `error` why it stopped early (a compile that fails leaves its size and the rest unused)."""

    def __init__(self):
        self.pending: set[tuple[int, int]] = set()
        self.error: Exception | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self, programs, groups: list, layout, progress=None):
        """Compiles the groups' programs (`Programs.compile_group` against `layout`) in a
        thread; progress: None, or called with the programs each group compiled."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(programs, groups, layout, progress),
                                        name="specjax-compile", daemon=True)
        _RUNNING.add(self)
        self._thread.start()

    def _run(self, programs, groups, layout, progress):
        for n, b in groups:
            if self._stop.is_set():
                return
            try:
                programs.compile_group(n, b, layout)
            except Exception as e:  # noqa: BLE001 - those groups stay unused; requests go in smaller ones
                self.error = e
                return
            self.pending.discard((n, b))
            if progress is not None:
                progress(len(programs.admissions))

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the thread to end (finished, failed or stopped); whether it has."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.running

    def stop(self):
        """Stops after the program being compiled (XLA's compile of one program cannot be
        interrupted) and waits; the groups not compiled stay unused."""
        self._stop.set()
        self.wait()
        _RUNNING.discard(self)
