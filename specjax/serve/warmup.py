"""`Warmup`: programs compiled in a background thread while the engine serves. Either the
prefills of several waiting requests at once (and their inserts), after the rest
(`Engine.compile_all(groups_later=True)`): until a (group size, bucket)'s programs are
compiled, its requests go in the sizes that are; or, first, every other program too
(`background=True`): a request meanwhile compiles the programs it needs on the engine's
thread (jit's own path), and the rest follow here.

It knows a `Programs` and a thread; nothing of requests or the device's state (engine.py).
"""

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


class _Stopped(Exception):
    """Raised between two programs once `stop` was asked."""


class Warmup:
    """One engine's background compile: `pending` the (n, bucket) groups not compiled yet,
    `left` the programs not compiled yet (groups' and the others'), `error` why it stopped
    early (a compile that fails leaves its size and the rest unused)."""

    def __init__(self):
        self.pending: set[tuple[int, int]] = set()
        self.left = 0
        self.error: Exception | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self, programs, groups: list, layout, progress=None, programs_first: int = 0):
        """Compiles the groups' programs (`Programs.compile_group` against `layout`) in a
        thread. layout: the state's layout, or a function of `tick` run first in the thread
        that compiles `programs_first` programs (calling tick with the number of each) and
        returns it. progress: None, or called with the programs each step compiled."""
        self._stop.clear()
        self.error = None
        self.left = programs_first + len(groups) * len(programs.admissions)
        self._thread = threading.Thread(target=self._run, args=(programs, groups, layout, progress),
                                        name="specjax-compile", daemon=True)
        _RUNNING.add(self)
        self._thread.start()

    def _run(self, programs, groups, layout, progress):
        def tick(n: int):
            self.left = max(0, self.left - n)
            if progress is not None:
                progress(n)
            if self._stop.is_set():
                raise _Stopped

        try:
            if callable(layout):
                layout = layout(tick)
            for n, b in groups:
                if self._stop.is_set():
                    return
                programs.compile_group(n, b, layout)
                self.pending.discard((n, b))
                tick(len(programs.admissions))
        except _Stopped:
            pass
        except Exception as e:  # noqa: BLE001 - those programs stay uncompiled; requests go in smaller groups
            self.error = e

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
