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
