"""Ctrl-C held while a process cannot take it: `interrupts_deferred`.

Shared by the command line (`glmtune.cli.main`, around the imports that building the parser
does) and the `--nproc-per-node` launcher (`glmtune.distributed.launch`, around torchrun's
import), so it lives below both.
"""

from __future__ import annotations

import signal
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
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
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
