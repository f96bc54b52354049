"""Start-up guard: a stale DeepSpeed op-build ``lock`` named, instead of a silent hang.

DeepSpeed loads its compiled ops (on CPU: ``deepspeed_shm_comm`` when the process groups
start, ``fused_adam`` when the engine builds its Adam/AdamW optimizer) through torch's JIT
extension loader at *every* start, built or not, unless DeepSpeed was installed with them
prebuilt (``DS_BUILD_FUSED_ADAM=1 DS_BUILD_SHM_COMM=1``, README Troubleshooting). The
loader creates ``<extensions dir>/<op>/lock`` (``O_EXCL``), keeps it open while it checks,
builds and imports the op (about 2 s when built, minutes when compiling), then removes it;
every other process waits in ``torch.utils.file_baton.FileBaton.wait`` while the file
exists. A process killed inside that window leaves the file behind, and every later start
waits on it forever, printing nothing.

A lock is *stale* here when no process on this machine has it open (the holder keeps its
file descriptor open from creation to removal; ``/proc/<pid>/fd``) and it is at least
:data:`STALE_AFTER_S` old (the age covers the moment between the holder's ``close`` and its
``remove``, and a holder on another machine sharing the folder, which ``/proc`` cannot
see, as long as its build writes nothing for that long). A stale lock is never removed
here: the message names it and how to clear it, and the run exits with
:data:`STALE_LOCK_EXIT`.

Two checks use that rule: :func:`stale_trainer_locks` (the local launcher, before any rank
starts) and :func:`watch_op_locks` (every rank, while it builds its engine: it names the
lock its main thread is actually waiting on).

A stopped start never leaves its own lock (one left by a Ctrl-C during start-up would block every
later start; ``train/held_locks.py``): inside :func:`watch_op_locks` the rank records each lock it *itself* creates
(torch's ``FileBaton.try_acquire`` succeeding; SIGINT/SIGTERM blocked across the create and
the record, and across the remove and the unrecord), and while it holds one a SIGINT or
SIGTERM first removes it (:func:`release_held_locks`: only a file that is still the one it
created, never a lock another process holds or waits on), stops the build processes it
started while holding it (``ninja``), then goes on as the signal would have (the handler
that was there, or the default: death by that signal). The stop paths that end a rank with
``os._exit`` call :func:`release_held_locks` too. A rank waiting on another's lock holds
none: it dies as before. Only SIGKILL (the launcher's, 15 s after its SIGTERM, or the OOM
killer) can still leave a lock; the next start then names it once it is 30 s old.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator

from hdet_scale.backends.op_builds import extensions_dir  # noqa: F401 (re-exported: tests, cli)
from hdet_scale.train.held_locks import (  # noqa: F401 (re-exported: stopping, tests)
    _on_stop,
    _tracking_batons,
    held_locks,
    release_held_locks,
)

#: Exit code of a start refused (launcher) or stopped (rank) by a stale lock.
STALE_LOCK_EXIT = 3
#: Age (s) from which a lock no process on this machine holds counts as stale.
STALE_AFTER_S = 30.0
#: Op folders the trainer's DeepSpeed engine loads (CPU and CUDA names).
TRAINER_OPS = ("deepspeed_shm_comm", "deepspeed_ccl_comm", "fused_adam", "cpu_adam")


def lock_holders(path: str) -> list[int] | None:
    """PIDs of the processes on this machine that have ``path`` open (``/proc/*/fd``), or
    ``None`` where ``/proc`` cannot tell (not Linux). Processes whose descriptors cannot
    be read (another user's) are skipped: the default extensions folder is per user."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    target = os.path.realpath(path)
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") == target:
                    pids.append(int(pid))
                    break
            except OSError:
                continue
    return pids


def lock_age(path: str, now: float | None = None) -> float | None:
    """Seconds since ``path`` was created (its mtime; the loader never writes to it), or
    ``None`` when it is gone. A symbolic link's own time (``lstat``): the loader's
    ``O_CREAT | O_EXCL`` open fails on any name that exists, a dangling link included."""
    try:
        return (time.time() if now is None else now) - os.lstat(path).st_mtime
    except (FileNotFoundError, NotADirectoryError):  # gone, or a file where a folder of its path should be
        return None


def check_extensions_dir(root: str | None = None) -> None:
    """Refuse an extensions folder (default :func:`extensions_dir`, i.e.
    ``$TORCH_EXTENSIONS_DIR``) that torch's op loader could not use: a file, a folder
    that cannot be created, or one this process cannot write. Each rank would otherwise
    end in a raw ``NotADirectoryError`` / ``FileNotFoundError`` traceback from the
    loader's ``os.makedirs``. Creates nothing that outlives the check (a probe folder,
    removed at once).

    Raises:
        HDETConfigError: naming ``TORCH_EXTENSIONS_DIR`` (or the default folder), its value
            and the problem.
    """
    from hdet_scale.errors import HDETConfigError

    given = root is not None or "TORCH_EXTENSIONS_DIR" in os.environ
    root = extensions_dir() if root is None else root
    name = (f"TORCH_EXTENSIONS_DIR={root!r}" if given else f"the DeepSpeed op folder {root}")
    fix = ("point TORCH_EXTENSIONS_DIR at a folder you can write (or unset it for the default, "
           "~/.cache/torch_extensions), where DeepSpeed keeps its compiled ops")
    if given and not root.strip():
        # torch reads "" as the working directory: every new folder would compile the ops
        # again into itself, with no word
        raise HDETConfigError(f"{name} is empty: torch would build DeepSpeed's ops into the working directory "
                              f"({os.getcwd()}), again from every other folder; {fix}")
    path = os.path.abspath(root or ".")
    # The nearest part of the path that exists: everything below it the loader must create.
    probe_in = path
    while not os.path.lexists(probe_in) and os.path.dirname(probe_in) != probe_in:
        probe_in = os.path.dirname(probe_in)
    if not os.path.isdir(probe_in):
        what = "is a file" if probe_in == path else f"cannot be created: {probe_in} is a file, not a folder"
        raise HDETConfigError(f"{name} {what}: {fix}")
    import tempfile

    # os.access is no answer as root (it says yes for /proc): try what the loader will do.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".hdet_probe_", dir=probe_in))
    except OSError as e:
        what = "is not writable" if probe_in == path else f"cannot be created in {probe_in}"
        raise HDETConfigError(f"{name} {what} ({e.strerror or e}): {fix}") from None


def is_stale(path: str, stale_after_s: float = STALE_AFTER_S) -> bool:
    """Whether the lock file ``path`` exists, is at least ``stale_after_s`` old, and no
    process on this machine holds it open."""
    age = lock_age(path)
    if age is None or age < stale_after_s:
        return False
    return not lock_holders(path)


def stale_trainer_locks(root: str | None = None) -> list[str]:
    """The stale locks (:func:`is_stale`) in the op folders the trainer loads
    (:data:`TRAINER_OPS`) under ``root`` (default :func:`extensions_dir`)."""
    root = extensions_dir() if root is None else root
    # an op DeepSpeed was installed with (DS_BUILD_<OP>=1) is imported, never JIT-loaded:
    # its folder's lock cannot block the start (README: prebuilt ops never need the lock)
    prebuilt = prebuilt_ops()
    locks = [os.path.join(root, op, "lock") for op in TRAINER_OPS if op not in prebuilt]
    return [p for p in locks if is_stale(p)]


def prebuilt_ops() -> set[str]:
    """The ops this DeepSpeed install holds compiled for this accelerator
    (``deepspeed.git_version_info.installed_ops``, as ``OpBuilder.load`` reads it); empty
    without DeepSpeed. Imports DeepSpeed."""
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import accelerator_name, installed_ops
    except ImportError:
        return set()
    if accelerator_name != get_accelerator()._name:
        return set()
    return {name for name, built in installed_ops.items() if built}


def _removal(path: str) -> tuple[str, str]:
    """``(what is there, the command that removes it)`` for the lock path ``path``:
    torch's loader makes a plain file (``""``: nothing more to say), but anything at that
    name blocks it, and ``rm`` refuses a folder."""
    try:
        if os.path.islink(path):  # rm removes the link itself, never its target
            return f"a symbolic link to {os.readlink(path)}", f"rm {path}"
        if os.path.isdir(path):
            return ("a folder, not the file torch's loader makes",
                    f"rmdir {path}" if not os.listdir(path) else f"rm -r {path}")
    except OSError:
        pass
    return "", f"rm {path}"


def stale_lock_message(path: str) -> str:
    """One message naming the stale lock ``path``, why it blocks, and the command that
    clears what is there (``rm`` for a file or link, ``rmdir`` / ``rm -r`` for a folder)."""
    age = lock_age(path)
    old = f"{age:.0f} s old" if age is not None else "gone by now"
    kind, command = _removal(path)
    return (f"DeepSpeed's op build lock {path} is stale ({old}{', ' + kind if kind else ''}; no process on this "
            "machine holds it): a DeepSpeed start was killed while it loaded its compiled ops, and every later start "
            f"would wait on it forever. Delete it ({command}) unless another machine sharing this folder is "
            "building DeepSpeed ops right now, then start again. To need no lock at all, install DeepSpeed "
            "with its ops prebuilt (README, Troubleshooting).")


def _waited_on_lock(thread_id: int) -> str | None:
    """The lock file the thread ``thread_id`` waits on in ``FileBaton.wait``, if it does."""
    from torch.utils.file_baton import FileBaton

    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code is FileBaton.wait.__code__:
            baton = frame.f_locals.get("self")
            return getattr(baton, "lock_file_path", None)
        frame = frame.f_back
    return None


def claim_naming(lock: str) -> socket.socket | bool | None:
    """Claim the right to name the stale lock ``lock`` among the ranks one launcher started
    (same parent process): a socket bound to an abstract name (Linux; nothing on disk,
    gone when the process ends) made of the parent's PID and the lock's path.

    Returns:
        The bound socket (keep it open while the claim should hold) when this process is
        the first; ``False`` when another process holds the claim; ``None`` where
        abstract sockets do not exist (not Linux): then every rank names it.
    """
    import hashlib

    key = hashlib.sha1(os.path.realpath(lock).encode()).hexdigest()[:16]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0hdet-stale-lock-{os.getppid()}-{key}")
    except OSError as e:
        sock.close()
        return False if e.errno == errno.EADDRINUSE else None
    return sock


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _builder(holders: list[int] | None) -> str:
    """Who holds a lock this process waits on, in words: the job's own ranks share this
    process's parent (the local launcher, or torchrun's agent): "waiting for process(es)
    [6469]" would leave a user to find that 6469 is the job's other rank."""
    if not holders:
        return "another process (on another machine sharing this extensions folder?)"
    listed = ", ".join(map(str, holders))
    if all(_parent(p) == os.getppid() for p in holders):
        return f"another rank of this job (process {listed})"
    return f"process(es) {listed}, not a rank of this job (another run using this extensions folder)"


def _note_own_builds(building: dict[str, float], noted: set[str], note_s: float) -> None:
    """One line for each lock this process has held for ``note_s`` seconds: the op build
    itself (a first run's ``fused_adam`` build, after the process group forms, is
    ~115 s of silence otherwise; the ranks waiting on it are not the announcing one when
    local rank 0 is the builder). ``building`` maps each held lock to when it was first
    seen (locks no longer held are dropped); ``noted``: the locks already named, which
    the waiting note shares."""
    now, held = time.monotonic(), set(held_locks())
    for path in list(building):
        if path not in held:
            del building[path]
    for path in held:
        first = building.setdefault(path, now)
        if path not in noted and now - first >= note_s:
            op = os.path.basename(os.path.dirname(path))
            os.write(2, (f"hdet-train: building DeepSpeed's {op} op for this machine (once per extensions folder; "
                         f"it can take a few minutes, and later starts load it): {path}\n").encode())
            noted.add(path)


@contextlib.contextmanager
def watch_op_locks(announce: bool, stale_after_s: float = STALE_AFTER_S, poll_s: float = 1.0,
                   waiting_note_s: float = 20.0, claim_hold_s: float = 3.0) -> Iterator[None]:
    """Watch this process's start-up (the engine build) for a wait on a stale lock.

    A daemon thread looks every ``poll_s`` seconds at the main thread: when it waits in
    ``FileBaton.wait`` on a lock that :func:`is_stale`, the process prints
    :func:`stale_lock_message` and exits with :data:`STALE_LOCK_EXIT` (``os._exit``: the
    main thread is stuck, and nothing was written yet). One rank of the launch prints it:
    the first to find it (:func:`claim_naming`) prints, then keeps its claim for
    ``claim_hold_s`` seconds before it exits; a rank finding it meanwhile exits silently
    (later ones are ended by the launcher, which stops the job when the first exits). When
    ``announce`` (local rank 0), a wait on a lock a live process holds (a build in
    progress) is reported after ``waiting_note_s``, once per lock, and so is a build this process
    runs itself (a lock it has held that long); otherwise both are left alone. Inside, the locks this process creates are recorded and a
    SIGINT / SIGTERM removes them (module docstring). Call from the main thread."""
    main_id = threading.get_ident()
    done = threading.Event()

    def watch() -> None:
        noted: set[str] = set()  # each lock's wait is noted once, not only the first lock's
        waiting: tuple[str, float] | None = None  # the lock waited on, since when (monotonic)
        building: dict[str, float] = {}  # lock this process holds -> when first seen (monotonic)
        while not done.wait(poll_s):
            if announce:
                _note_own_builds(building, noted, waiting_note_s)
            lock = _waited_on_lock(main_id)
            if lock is None:
                waiting = None
                continue
            if waiting is None or waiting[0] != lock:
                waiting = (lock, time.monotonic())
            if is_stale(lock, stale_after_s):
                # The first rank of this launch to find it says so (any rank: the launcher may
                # end the others, local rank 0 included, as soon as one exits, before they look);
                # the others that find it while it holds its claim exit without repeating it.
                claim = claim_naming(lock)
                if claim is not False:
                    os.write(2, f"hdet-train: error: {stale_lock_message(lock)}\n".encode())
                    time.sleep(claim_hold_s if claim is not None else 0.0)
                release_held_locks()  # none while waiting, as torch loads one op at a time
                os._exit(STALE_LOCK_EXIT)
            if announce and lock not in noted and time.monotonic() - waiting[1] >= waiting_note_s:
                op = os.path.basename(os.path.dirname(lock))
                os.write(2, (f"hdet-train: waiting for {_builder(lock_holders(lock))} building DeepSpeed's {op} op "
                             "for this machine (once per extensions folder; it can take a few minutes, and later "
                             f"starts load it): {lock}\n").encode())
                noted.add(lock)

    thread = threading.Thread(target=watch, name="hdet-op-lock-watch", daemon=True)
    thread.start()
    try:
        with _tracking_batons():
            yield
    finally:
        done.set()
