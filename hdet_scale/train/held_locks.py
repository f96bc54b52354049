"""The op-build locks this process created, removed when a signal stops it.

A rank stopped while torch's loader holds ``<extensions dir>/<op>/lock`` would leave it
behind, and every later start would wait on it. Inside ``startup.watch_op_locks`` torch's
``FileBaton.try_acquire`` / ``release`` are routed through :func:`_tracking_batons`, which
records each lock this process itself creates (SIGINT/SIGTERM/SIGHUP blocked across the
create and the record); while one is held, a stop signal first removes it
(:func:`release_held_locks`: only a file that is still the one it created) and stops the
build processes it started, then does what it would have done. Split from
``train/startup.py``, which names stale locks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# lock path -> (its open descriptor, st_dev and st_ino of the file this process created, its
# child PIDs before). The descriptor stays open until the release: the inode cannot be reused.
_held: dict[str, tuple[int, int, int, frozenset[int]]] = {}
_replaced: dict[int, Any] = {}  # signal -> the handler _on_stop stands in for while a lock is held


def _children() -> frozenset[int]:
    """PIDs of this process's children (``/proc/*/stat``); empty where ``/proc`` is absent."""
    me, found = os.getpid(), set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return frozenset()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                if int(f.read().rsplit(b")", 1)[1].split()[1]) == me:
                    found.add(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    return frozenset(found)


@contextlib.contextmanager
def _stop_signals_blocked() -> Iterator[None]:
    """SIGINT and SIGTERM held back in this thread (delivered when the block ends)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def held_locks() -> list[str]:
    """The op-build locks this process created (inside ``startup.watch_op_locks``) and holds."""
    return list(_held)


def release_held_locks() -> list[str]:
    """Remove the locks :func:`held_locks` names, each only while its path is still the file
    this process created (same device and inode as its still open descriptor), after SIGTERM to the processes this one
    started while holding it (the op build: ``ninja``, whose compilers it stops). For the
    stop paths; never raises. Returns the paths removed."""
    removed = []
    for path, (fd, dev, ino, before) in list(_held.items()):
        for pid in _children() - before:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        try:
            st, mine = os.lstat(path), os.fstat(fd)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino) == (dev, ino):
                os.remove(path)
                removed.append(path)
        except OSError:
            pass
        _held.pop(path, None)
    return removed


def _on_stop(signum: int, frame: Any) -> None:
    """SIGINT / SIGTERM while this process holds a lock: remove it, then what the signal
    would have done without this handler."""
    release_held_locks()
    previous = _replaced.get(signum, signal.SIG_DFL)
    _disarm()
    if callable(previous):
        previous(signum, frame)  # e.g. stopping.install_rank_handlers': os._exit
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # the default action: death by this signal, as before
    time.sleep(5)  # not reached while the signal is unblocked here
    os._exit(128 + signum)


def _arm() -> None:
    if _replaced or threading.current_thread() is not threading.main_thread():
        return  # armed, or not allowed (the stop paths still call release_held_locks)
    for s in _STOP_SIGNALS:
        previous = signal.getsignal(s)
        if previous not in (signal.SIG_IGN, None):  # ignored (a local launcher's rank: SIGINT) stays ignored
            _replaced[s] = previous
            signal.signal(s, _on_stop)


def _disarm() -> None:
    if not _replaced or threading.current_thread() is not threading.main_thread():
        return
    for s, previous in _replaced.items():
        signal.signal(s, previous)
    _replaced.clear()


def _try_acquire(baton: Any, original: Any) -> bool:
    with _stop_signals_blocked():  # a signal between the create and the record would leave the file
        before = _children()
        acquired = original(baton)
        if acquired:
            st = os.fstat(baton.fd)
            _held[baton.lock_file_path] = (baton.fd, st.st_dev, st.st_ino, before)
            _arm()
    return acquired


def _release(baton: Any, original: Any) -> None:
    with _stop_signals_blocked():
        try:
            original(baton)
        finally:
            _held.pop(baton.lock_file_path, None)
            if not _held:
                _disarm()


@contextlib.contextmanager
def _tracking_batons() -> Iterator[None]:
    """Route torch's ``FileBaton.try_acquire`` / ``release`` through the recording above
    (class attributes: every baton of this process, whichever module made it)."""
    from torch.utils.file_baton import FileBaton

    acquire, release = FileBaton.try_acquire, FileBaton.release
    if getattr(acquire, "_hdet_tracked", False):  # nested: already routed
        yield
        return

    def try_acquire(self: Any) -> bool:
        return _try_acquire(self, acquire)

    def release_(self: Any) -> None:
        _release(self, release)

    try_acquire._hdet_tracked = True  # type: ignore[attr-defined]
    FileBaton.try_acquire, FileBaton.release = try_acquire, release_  # type: ignore[method-assign]
    try:
        yield
    finally:
        FileBaton.try_acquire, FileBaton.release = acquire, release  # type: ignore[method-assign]
        _held.clear()  # the loader releases in its own finally: nothing is held past here
        _disarm()
