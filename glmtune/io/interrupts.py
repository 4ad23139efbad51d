"""Ctrl-C held while a process cannot take it (`interrupts_deferred`), and never lost (`interrupts_recorded`).

Shared by the command line (`glmtune.cli.main`, around the imports that building the parser
does, and around the command) and the `--nproc-per-node` launcher (`glmtune.distributed.launch`,
around torchrun's import), so it lives below both.

`interrupts_recorded` keeps Python's behaviour (a KeyboardInterrupt where the signal lands) and
also records that the signal came: native code that calls back into Python can swallow the
KeyboardInterrupt (a library that checks for signals and drops the error) or wrap it in another
exception (torch's C++ turns it into a RuntimeError). `glmtune train` asks `raise_if_interrupted`
between its steps, and the command line reports any failure after a recorded Ctrl-C as
"interrupted".

A KeyboardInterrupt raised inside a finalizer (`__del__`, a weakref callback: a tokenizer's regex
object collected as the signal lands) cannot propagate: Python prints it as "Exception ignored",
a traceback, and carries on. Inside `interrupts_recorded` nothing is printed for it: it is
recorded, and the command stops at its next `raise_if_interrupted` (a rank that waits in a
collective for ranks that have stopped is ended by torchrun). Raising it again outside the
finalizer is not done: a signal re-sent from the hook runs its handler inside the hook (the
interpreter checks for signals after each call), where it is ignored in turn.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives inside the block; raise KeyboardInterrupt at its end.

    Why: importing torch calls back into Python from C++. A KeyboardInterrupt raised in
    such a callback aborts the process (pybind11's `terminate called ... KeyboardInterrupt`,
    SIGABRT) or, caught, still leaves Python's exit status at "killed by SIGINT". Outside
    the main thread, or where SIGINT is not Python's default handler (ignored by a shell's
    `&`, or a caller's own), the block runs as it is.

    A launcher starts its processes with SIGINT blocked (`glmtune.distributed.launch`), so
    that a Ctrl-C cannot interrupt the interpreter's own start-up (no glmtune code yet, a
    traceback): it stays pending until here, where the handler is in place to hold it.
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, _record_then_raise)):
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


_received = threading.Event()


def _record_then_raise(signum, frame) -> None:
    _received.set()
    signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt, as Python's own handler


def _unraisable_hook(previous_hook):
    """Python's hook for errors it cannot raise, quiet about a Ctrl-C (recorded already)."""
    def hook(report) -> None:
        if report.exc_type is None or not issubclass(report.exc_type, KeyboardInterrupt):
            previous_hook(report)
    return hook


@contextmanager
def interrupts_recorded() -> Iterator[None]:
    """Within the block, a Ctrl-C raises KeyboardInterrupt as usual and is also recorded (module
    docstring); outside the main thread, or where SIGINT is not Python's default handler, the block
    runs as it is. A handler installed inside the block (the trainer's) replaces it for its time."""
    _received.clear()
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    previous = signal.signal(signal.SIGINT, _record_then_raise)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _unraisable_hook(previous_hook)
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGINT, previous)


def interrupt_received() -> bool:
    """A Ctrl-C came inside `interrupts_recorded` (whatever became of its KeyboardInterrupt)."""
    return _received.is_set()


def raise_if_interrupted() -> None:
    """KeyboardInterrupt if a Ctrl-C came inside `interrupts_recorded` and was swallowed since."""
    if _received.is_set():
        raise KeyboardInterrupt
