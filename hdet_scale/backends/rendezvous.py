"""Joining the process group from a launcher's environment, stoppable by a signal.

``init_process_group`` waits in torch's TCPStore rendezvous until all ``WORLD_SIZE``
ranks have joined: up to 30 minutes (torch's default timeout) when a peer never comes
(a stray ``RANK`` / ``WORLD_SIZE`` in a shell, a wrong ``MASTER_ADDR``, the other node's
launch failed). The main thread is inside C++ all that time, so a Python signal handler
(``KeyboardInterrupt``, hdet-train's stop handlers) never runs: Ctrl-C, ``timeout``'s
SIGTERM and a scheduler's SIGTERM would be ignored until ``kill -9``. For that window
only, SIGINT, SIGTERM and SIGHUP get their default action (the
process ends by the signal: exit 130 / 143 / 129 in a shell); the handlers that were there
come back as soon as the group exists. A handler set to ignore stays ignored.

The wait also speaks: every ``notice_every`` seconds (60) a line on
stderr names the rank, how long it has waited and the address it waits at, and torch's
timeout (``DistStoreError: Timed out ... 1/2 clients joined``, a traceback after 30
minutes) becomes one :class:`HDETConfigError` naming the same. torch releases the GIL in
the wait, so a daemon thread can print.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

from hdet_scale.errors import HDETConfigError

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


NOTICE_EVERY_S = 60.0


def _where() -> str:
    env = os.environ
    return (f"rank {env.get('RANK', '?')} of WORLD_SIZE={env.get('WORLD_SIZE', '?')} at MASTER_ADDR:MASTER_PORT = "
            f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}")


def _announce(done: threading.Event, every: float) -> None:
    from hdet_scale.backends.op_builds import builds_in_progress

    t0 = time.monotonic()
    while not done.wait(every):
        waited = f"still waiting for the process group to form after {time.monotonic() - t0:.0f} s ({_where()})"
        building = builds_in_progress()
        if building:
            # on a first run a rank compiles DeepSpeed's ops inside
            # init_distributed for minutes; the network is not the cause then
            why = (f"a DeepSpeed op is being built on this machine ({building[0]}), which takes minutes on a "
                   "first run; the ranks join when it is done")
        else:
            why = ("a rank has not joined; check that every rank was started with the same MASTER_ADDR, MASTER_PORT "
                   "and WORLD_SIZE (on a first run, a rank on another machine may still be building DeepSpeed's "
                   "ops; torch gives up after its timeout, 30 min by default; Ctrl-C stops it)")
        print(f"hdet_scale: {waited}: {why}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def joining(notice_every: float = NOTICE_EVERY_S) -> Iterator[None]:
    """Wrap ``init_process_group`` / ``deepspeed.init_distributed``: stoppable by a signal
    (:func:`stoppable`), a progress line on stderr every ``notice_every`` seconds while it
    waits, and torch's rendezvous timeout turned into one message.

    Raises:
        HDETConfigError: the rendezvous timed out (rank 0: ``DistStoreError`` "Timed out
            ... waiting for clients"; another rank: ``DistNetworkError`` "timed out ... while
            trying to connect"): names the rank, WORLD_SIZE, MASTER_ADDR:MASTER_PORT and
            torch's own line. Other errors (a port in use) pass unchanged.
    """
    from torch.distributed import DistNetworkError, DistStoreError

    done = threading.Event()
    threading.Thread(target=_announce, args=(done, notice_every), daemon=True, name="hdet-rendezvous").start()
    try:
        with stoppable():
            yield
    except (DistStoreError, DistNetworkError) as e:
        # rank 0 times out waiting for clients (DistStoreError), a client waiting for rank 0's
        # store to listen (DistNetworkError); a port in use is no timeout and stays as it is
        text = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
        if "timed out" not in text.lower():
            raise
        raise HDETConfigError(f"environment: the process group did not form ({_where()}): {text[:300]}; start "
                              "every rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, or let "
                              "torchrun start them") from None
    finally:
        done.set()


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
