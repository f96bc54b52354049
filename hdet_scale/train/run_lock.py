"""One job per ``run_dir``: the lock ``hdet-train`` holds for a whole run, and the check a
second job's launcher makes before anything else (docs/failure_semantics.md, "Two jobs in
one run_dir").

Standard library only, and imported before torch: the launcher refuses a run_dir in use
within a second, not after the 20-30 s a loaded machine takes to import torch and
DeepSpeed. :mod:`hdet_scale.train.rundir` re-exports these names.
"""

from __future__ import annotations

import os

from hdet_scale.errors import HDETConfigError

LOCK_FILE = ".hdet_run.lock"  # held (flock) by the job training in this run_dir
_held: list[int] = []  # this process's lock descriptors: open until it exits


def hold_run_dir(run_dir: str) -> None:
    """Take ``run_dir``'s lock for the rest of this process: an exclusive ``flock`` on
    ``run_dir/.hdet_run.lock``, which the kernel releases when the process ends however it
    ends (so no stale lock survives a crash or SIGKILL). Two jobs started in one run_dir
    would interleave their metrics and overwrite each other's checkpoints; the second is
    refused. Taken by the one process that speaks for the job (``hdet-train``'s launcher,
    or global rank 0 under ``torchrun``), after ``run_dir`` is known to be writable. On a
    filesystem without ``flock`` (some network mounts), nothing is held.

    Raises:
        HDETConfigError: another process holds the lock (the message names it as it
            recorded itself: pid, host, start time).
    """
    import fcntl
    import socket
    import time

    path = os.path.join(run_dir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise _in_use(run_dir, holder) from None
    except OSError:  # no flock here: run unguarded rather than refuse
        os.close(fd)
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
    _held.append(fd)


def _in_use(run_dir: str, holder: str) -> HDETConfigError:
    return HDETConfigError(f"run_dir: {run_dir} is in use by a running hdet-train ({holder}); two jobs in one "
                           "run_dir would mix their metrics and checkpoints: wait for it to end, stop it, or "
                           "choose another run_dir")


def holder(run_dir: str) -> str | None:
    """Who holds ``run_dir``'s lock, as it recorded itself (``"pid N on HOST, since ..."``,
    or ``"another process"``), or ``None``: no job is training there. Takes no lock (a
    shared one for a moment, released before returning). Never raises."""
    import fcntl

    path = os.path.join(run_dir, LOCK_FILE)
    if not os.path.isfile(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
    except OSError:
        return None
    finally:
        os.close(fd)  # closing releases a shared lock this took
    return None


def check_not_in_use(run_dir: str) -> None:
    """:func:`hold_run_dir`'s refusal, without taking the lock: the launcher asks first,
    so that a job started in a run_dir in use is told so, not given advice about the
    running job's files (a resume is not told to start over).

    Raises:
        HDETConfigError: as :func:`hold_run_dir`.
    """
    if (held_by := holder(run_dir)) is not None:
        raise _in_use(run_dir, held_by)
