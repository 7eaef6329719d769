"""What tokload does when the interpreter exits, in order.

The one job of this module: run the exit steps of the modules that own threads,
in a fixed order, before the interpreter finalizes. A thread that runs Python
(or takes the GIL from C++ or Rust code: a torch tensor freed, an object-store
answer handed over) once the interpreter is finalizing is ended with
``pthread_exit``, which cannot unwind through C++ or Rust frames: the process
aborts (SIGABRT, "terminate called without an active exception") after a run
that did all its work, as a script that leaves its loop without
``loader.close()`` did. So, at exit:

1. ``FETCHES``: the object-store reads in progress are abandoned: their batches
   fail and no GET is sent after this (``tokload.remote.fetch``), so that no
   reader thread waits on a store that answers slowly or not at all;
2. ``READERS``: the DataLoader's reader threads are told to stop and joined
   (``tokload.prefetch``): no read starts after this;
3. ``CLIENT``: the object-store client's requests in flight complete and its
   threads leave Python (``tokload.remote.loop.quiesce``).

A Ctrl+C while a step waits ends the process at once (killed by SIGINT, as an
uncaught Ctrl+C ends Python): going on to finalize with the threads still running
would abort it.

``atexit`` runs its handlers last registered first, and these modules register
when first used, in no fixed order: hence one handler here, which runs the steps
by stage.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

FETCHES = 0
"""Abandon the object-store reads in progress (no new GET)."""
READERS = 1
"""Stop the reader threads (no new reads)."""
CLIENT = 2
"""Let the object-store client's threads leave Python."""

_steps: list[tuple[int, int, Callable[[], Any]]] = []
_lock = threading.Lock()


def at_exit(stage: int, step: Callable[[], Any]) -> None:
    """Run ``step()`` at exit, after the steps of earlier stages (and, within a
    stage, in the order given)."""
    with _lock:
        if not _steps:
            atexit.register(_run)
        _steps.append((stage, len(_steps), step))


def _run() -> None:
    with _lock:
        steps = sorted(_steps, key=lambda s: s[:2])
    for _, _, step in steps:
        try:
            step()
        except KeyboardInterrupt:
            _leave_now()
        except Exception:  # one step's failure does not skip the next
            traceback.print_exc()


def _leave_now() -> None:
    """A Ctrl+C while a step waits for tokload's threads (a second one, as a rule: the
    first ended the program): the process ends at once, killed by SIGINT as Python
    ends on an uncaught Ctrl+C (so that a shell loop stops too; status 130 where the
    signal cannot be delivered). Finalizing the interpreter with those threads still
    running would make it abort (SIGABRT, "terminate called without an active
    exception"), and skipping the steps left would too; so the later exit handlers
    are skipped instead (stdout and stderr are flushed)."""
    print(
        "tokload: interrupted while waiting for its threads at exit: leaving at once",
        file=sys.stderr,
    )
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    with contextlib.suppress(Exception):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(130)
