"""Refusing what is not a regular file before opening it: ``open`` on a FIFO waits for a
writer forever (a hang with nothing printed), and a device or socket is never a config."""

from __future__ import annotations

import os
import stat

from hdet_scale.errors import HDETConfigError


def file_kind(mode: int) -> str:
    """What ``os.stat``'s ``st_mode`` describes, in words, for a file that is not regular."""
    for test, name in ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def require_regular(path: str | os.PathLike, what: str) -> None:
    """Raise HDETConfigError naming ``what`` and ``path`` when ``path`` exists and is
    neither a regular file nor a folder (a FIFO, a device, a socket), without opening it;
    a missing path or a folder is left to the caller's own message."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise HDETConfigError(f"{what} {os.fspath(path)!r} is not a regular file but a {file_kind(mode)}: "
                              "give the path of a file")


def check_output_file(path: str | os.PathLike, key: str) -> None:
    """Refuse, without creating or opening anything, an output file path (``key``, the
    config key it comes from) that rank 0 could not open for writing at its first record:
    a folder, a special file, a broken symbolic link, a parent that is a file, or a folder
    this user cannot write. Called on every rank before the first collective, so that a
    bad path stops the job at once on every rank rather than as rank 0's ``IsADirectoryError``
    at step 1 and every other rank's lost-peer error. A missing file is
    fine; a missing parent is fine when the nearest existing folder above it is writable
    (the logger creates it).

    Raises:
        HDETConfigError: naming ``key``, the path and what is wrong.
    """
    path = os.fspath(path)
    refuse_kernel_fs(path, key)  # root may "write" there, and open fails at step 1
    if os.path.isdir(path):
        raise HDETConfigError(f"{key}: {path} is a folder; give the path of a file "
                              f"(e.g. {os.path.join(path, 'metrics.jsonl')})")
    require_regular(path, key)
    if os.path.islink(path) and not os.path.exists(path):
        raise HDETConfigError(f"{key}: {path} is a symbolic link to {os.readlink(path)!r}, which does not exist; "
                              "create its target or give another path")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise HDETConfigError(f"{key}: {path} exists and this user cannot write it; give another path")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise HDETConfigError(f"{key}: {parent} (above {path}) is not a folder; give a path under a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise HDETConfigError(f"{key}: this user cannot create {path} (folder {parent} is not writable); "
                              "give a path in a folder this user can write")


def refuse_kernel_fs(path: str | os.PathLike, key: str) -> None:
    """Raise HDETConfigError naming ``key`` when ``path`` resolves into /proc or /sys:
    kernel filesystems, where nothing a run writes belongs (``os.access`` says yes to
    root there, and the write fails later)."""
    path = os.fspath(path)
    real = os.path.realpath(os.path.expanduser(path))
    for root in ("/proc", "/sys"):
        if real == root or real.startswith(root + os.sep):
            raise HDETConfigError(f"{key}: {path} is in {root}, a kernel filesystem, not storage; choose a folder "
                                  "on a disk this user can write")
