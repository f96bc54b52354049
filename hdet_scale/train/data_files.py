"""Which files ``data.path`` names, for :func:`hdet_scale.train.data.load_corpus`.

``data.path`` takes text files and folders of them (the model reads their bytes, but a
binary file trained on as text is a mistake, not a corpus). A file named directly must be
a regular file whose first :data:`SNIFF_BYTES` are UTF-8 text, or the run is refused
naming it; inside a folder such files are skipped (a source tree holds images and build
outputs), as are hidden files and folders. Nothing here opens anything but a regular
file, so a FIFO named by mistake never blocks the start.
"""

from __future__ import annotations

import codecs
import os
import pathlib
import stat
import sysconfig

from hdet_scale.errors import HDETConfigError
from hdet_scale.paths import file_kind
from hdet_scale.train.config_files import relative_note

#: Directory names never descended into when collecting the default corpus.
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)

#: Leading bytes of a file checked for being text (NUL bytes, invalid UTF-8).
SNIFF_BYTES = 64 * 1024


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def default_corpus_files() -> list[pathlib.Path]:
    """Return the ``.py`` files of this interpreter's standard library.

    The root is ``sysconfig.get_paths()["stdlib"]``. Directories named
    ``site-packages``, ``dist-packages``, ``test``, ``tests``, ``idlelib``,
    ``lib2to3`` and ``__pycache__`` (and hidden directories) are skipped.

    Returns:
        Absolute paths, sorted by their POSIX path relative to the stdlib root, so the
        order is identical on every rank and machine with the same Python version.
    """
    root = stdlib_root()
    rels: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS and not d.startswith(".")
        ]
        rel_dir = pathlib.PurePath(dirpath).relative_to(root)
        for name in filenames:
            if name.endswith(".py") and not name.startswith("."):
                rels.append((rel_dir / name).as_posix())
    rels.sort()
    return [root / rel for rel in rels]


def not_text(path: pathlib.Path) -> str | None:
    """Why the regular file ``path`` is not UTF-8 text, judged by its first
    :data:`SNIFF_BYTES` (``"a NUL byte at byte 12"``, ``"invalid UTF-8 at byte 3"``), or
    ``None`` when they are text. A multi-byte character cut by the 64 KiB boundary is
    not held against it. Raises OSError when the file cannot be read."""
    with open(path, "rb") as fh:
        head = fh.read(SNIFF_BYTES + 1)
    whole = len(head) <= SNIFF_BYTES
    head = head[:SNIFF_BYTES]
    nul = head.find(b"\x00")
    if nul >= 0:
        return f"a NUL byte at byte {nul}"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=whole)
    except UnicodeDecodeError as e:
        return f"invalid UTF-8 at byte {e.start}"
    return None




def _folder_files(folder: pathlib.Path) -> list[tuple[str, pathlib.Path]]:
    """Regular, non-hidden UTF-8 text files under ``folder`` (:func:`not_text`), sorted
    by relative path."""
    found: list[tuple[str, pathlib.Path]] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        rel_dir = pathlib.PurePath(dirpath).relative_to(folder)
        for name in filenames:
            if name.startswith("."):
                continue
            full = pathlib.Path(dirpath) / name
            try:
                # stat before open: a FIFO or device is skipped without being opened
                if not stat.S_ISREG(os.stat(full).st_mode) or not_text(full) is not None:
                    continue
            except OSError:
                continue
            found.append(((rel_dir / name).as_posix(), full))
    found.sort(key=lambda item: item[0])
    return found


def _one_file(part: str, p: pathlib.Path) -> None:
    """Refuse a file named directly in ``data.path`` that is unreadable or not text."""
    try:
        reason = not_text(p)
    except OSError as e:
        raise HDETConfigError(f"data.path: file {part!r} cannot be read: {e.strerror or e}") from None
    if reason is not None:
        raise HDETConfigError(
            f"data.path: file {part!r} is not UTF-8 text ({reason} in its first {SNIFF_BYTES // 1024} KiB): "
            "data.path takes text files or folders of them; is it the right file?"
        )


# Kernel pseudo-filesystems: their "files" are generated on read (and a folder such as
# /proc/self walks the live process), so a run on them trains on whatever the system says.
PSEUDO_ROOTS = ("/proc", "/sys")


def _pseudo_root(p: pathlib.Path) -> str | None:
    real = os.path.realpath(p)
    return next((r for r in PSEUDO_ROOTS if real == r or real.startswith(r + "/")), None)


def check_apart(path: str | None, run_dir: str) -> None:
    """Refuse a ``data.path`` part that holds ``run_dir`` or lies inside it.

    A run_dir inside a data folder makes the run's own files (``metrics.jsonl``,
    checkpoints, ``latest``) training data: a resume then trains on other bytes than the
    run it continues, or is refused for a split that shrank (tester round 23: "data set
    too small: it has 13 bytes", the ``latest`` file). Data inside run_dir is removed by
    ``train.overwrite=true``. Compared by real path (links resolved).

    Raises:
        HDETConfigError: naming the part, run_dir and the way out.
    """
    if path is None:
        return
    out = os.path.realpath(os.path.expanduser(run_dir))
    for part in (p.strip() for p in path.split(",") if p.strip()):
        real = os.path.realpath(os.path.expanduser(part))
        if out == real or out.startswith(real.rstrip(os.sep) + os.sep):
            raise HDETConfigError(f"data.path: {part!r} holds run_dir {run_dir!r}: the run's own files (metrics, "
                                  "checkpoints) would be read as training data, and a resume would train on other "
                                  "data than the run it continues; put run_dir outside data.path")
        if real.startswith(out + os.sep):
            raise HDETConfigError(f"data.path: {part!r} is inside run_dir {run_dir!r}, whose contents belong to "
                                  "the run (train.overwrite=true removes them); keep the data outside run_dir")


def collect(path: str) -> tuple[list[tuple[str, pathlib.Path]], str]:
    """Resolve ``data.path`` into ``([(key, file)], source)`` in concatenation order.

    Raises:
        HDETConfigError: naming the part of ``data.path`` that names nothing, a broken
            link, a path in /proc or /sys, something other than a regular file or folder (a device such as
            ``/dev/null``, a FIFO, a socket), an unreadable or non-text file, or a
            folder without any text file.
    """
    parts = [p.strip() for p in path.split(",") if p.strip()]
    if parts and len(parts) != len(path.split(",")):
        # tester round 13: "a,,b" and "a," were read as "a,b" and "a" without a word
        raise HDETConfigError(f"data.path={path!r} has an empty item between its commas: give each path once, "
                              "separated by single commas")
    if not parts:
        raise HDETConfigError(f"data.path={path!r} names no path: give a text file or folder, or leave data.path "
                              "out (or null) to train on the built-in corpus (the Python standard library's sources)")
    files: list[tuple[str, pathlib.Path]] = []
    seen: set[pathlib.Path] = set()
    for index, part in enumerate(parts):
        p = pathlib.Path(part).expanduser()
        # Prefix keys with the argument index when several paths are given, so that
        # equal relative paths under different folders hash differently.
        prefix = f"{index}:" if len(parts) > 1 else ""
        try:
            mode = os.stat(p).st_mode
        except FileNotFoundError:
            if os.path.islink(p):
                raise HDETConfigError(f"data.path: {part!r} is a broken symbolic link (to "
                                      f"{os.readlink(p)!r}, which does not exist)") from None
            raise HDETConfigError(f"data.path: {part!r} does not exist{relative_note(part)}") from None
        except OSError as e:
            raise HDETConfigError(f"data.path: {part!r} cannot be read: {e.strerror or e}") from None
        pseudo = _pseudo_root(p)
        if pseudo is not None:
            raise HDETConfigError(f"data.path: {part!r} is in {pseudo}, a kernel pseudo-filesystem whose files "
                                  "describe the running system and change while it runs: data.path takes text "
                                  "files or folders of them")
        if stat.S_ISDIR(mode):
            members = _folder_files(p)
            if not members:
                raise HDETConfigError(
                    f"data.path: folder {part!r} contains no readable, non-hidden UTF-8 text files"
                )
            entries = [(prefix + rel, full) for rel, full in members]
        elif stat.S_ISREG(mode):
            _one_file(part, p)
            entries = [(prefix + p.name, p)]
        else:
            raise HDETConfigError(f"data.path: {part!r} is not a regular file but a {file_kind(mode)}: data.path "
                                  "takes text files or folders of them")
        for key, full in entries:
            real = full.resolve()
            if real not in seen:
                seen.add(real)
                files.append((key, full))
    return files, ",".join(parts)
