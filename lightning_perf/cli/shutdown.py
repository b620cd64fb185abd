"""How the ``lightning-perf`` command's process ends once its subcommand is done.

After a compiled fit the interpreter's own teardown is slow for nothing: while it takes its modules
apart it runs full garbage collections, each walking every object still alive (torch's, Lightning's,
Dynamo's and Inductor's structures, the model: hundreds of thousands to millions of them), to free
memory the operating system takes back at once anyway. :func:`end_process` does what the
interpreter's exit does that has an effect outside the process, in the same order, and then ends it
without the teardown:

1. waits for the threads that are not daemons (a checkpoint writer's, an executor's), as Python does;
2. runs the ``atexit`` handlers: the loggers' and ``logging``'s flush, ``weakref.finalize`` clean-ups
   (temporary folders), multiprocessing's children, Inductor's compile workers;
3. closes every file object still open (what its deallocation would have done: buffered writes reach
   the file) and flushes the standard streams;
4. ``os._exit``.

What is skipped is the freeing of the objects left, the C++ static destructors (which can stall on a
process group's teardown) included. The command ends this way after ``fit``, ``validate``, ``test``
and ``predict`` only, whose loggers, checkpoints and reports the Trainer has closed by then.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import threading
from typing import NoReturn

__all__ = ["end_process"]


def end_process(code: int = 0) -> NoReturn:
    """End this process with exit status ``code`` as described in the module docstring."""
    shutdown_threads = getattr(threading, "_shutdown", None)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if shutdown_threads is None or run_exit_handlers is None:  # an interpreter without them: the usual exit
        sys.exit(code)
    shutdown_threads()
    run_exit_handlers()
    _close_open_files()
    os._exit(code)


def _close_open_files() -> None:
    files = [obj for obj in gc.get_objects() if isinstance(obj, io.IOBase)]
    # the outer layers first: a text file's close flushes into its buffer, the buffer's into the raw file
    layers = (io.TextIOBase, io.BufferedIOBase, io.IOBase)
    for layer in layers:
        for obj in files:
            if not isinstance(obj, layer):
                continue
            try:
                if not obj.closed and not _standard_stream(obj):
                    obj.close()
            except (OSError, ValueError):  # a broken pipe, a file closed underneath
                continue
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            continue


def _standard_stream(obj: io.IOBase) -> bool:
    """Whether ``obj`` is (a layer of) standard input, output or error: flushed, never closed."""
    try:
        return obj.fileno() in (0, 1, 2)
    except (OSError, ValueError):  # no file descriptor (an in-memory buffer)
        return False
