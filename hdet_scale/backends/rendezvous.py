"""Joining the process group from a launcher's environment, stoppable by a signal.

``init_process_group`` waits in torch's TCPStore rendezvous until all ``WORLD_SIZE``
ranks have joined: up to 30 minutes (torch's default timeout) when a peer never comes
(a stray ``RANK`` / ``WORLD_SIZE`` in a shell, a wrong ``MASTER_ADDR``, the other node's
launch failed). The main thread is inside C++ all that time, so a Python signal handler
(``KeyboardInterrupt``, hdet-train's stop handlers) never runs: Ctrl-C, ``timeout``'s
SIGTERM and a scheduler's SIGTERM were ignored until ``kill -9`` (tester round 23 of
issue 9). For that window only, SIGINT, SIGTERM and SIGHUP get their default action (the
process ends by the signal: exit 130 / 143 / 129 in a shell); the handlers that were there
come back as soon as the group exists. A handler set to ignore stays ignored.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stoppable() -> Iterator[None]:
    """While open, a stop signal ends this process at once (see the module docstring).
    Main thread only (elsewhere signals cannot be set): a no-op in other threads."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {}
    for s in _STOP_SIGNALS:
        handler = signal.getsignal(s)
        if callable(handler):  # Python handlers cannot run from inside the rendezvous
            saved[s] = handler
            signal.signal(s, signal.SIG_DFL)
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
