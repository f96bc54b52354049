"""Which files ``data.path`` names, for :func:`hdet_scale.train.data.load_corpus`.

``data.path`` takes text files and folders of them (the model reads their bytes, but a
binary file trained on as text is a mistake, not a corpus). A file named directly must be
a regular file whose first :data:`SNIFF_BYTES` are UTF-8 text, or the run is refused
naming it; inside a folder such files are skipped (a source tree holds images and build
outputs), as are hidden files and folders. A file or folder inside a folder that this
process may not read is not skipped: the run is refused, naming them. Linked files and
linked folders inside a folder are followed; a folder or file reached by several paths is
read once. A file of a folder is opened to be judged only when the reading comes to it
(:class:`Files`), so a large folder costs one ``stat`` and one ``access`` per file.
Nothing here opens anything but a regular file, so a FIFO named by mistake never blocks
the start.
"""

from __future__ import annotations

import codecs
import errno
import os
import pathlib
import stat
import sys
import sysconfig
import time
from typing import Iterator

from hdet_scale.errors import HDETConfigError
from hdet_scale.paths import file_kind
from hdet_scale.train.config_files import relative_note
from hdet_scale.train.data_place import refuse_link_to_run_dir

#: Directory names never descended into when collecting the default corpus.
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)

#: Leading bytes of a file checked for being text (NUL bytes, invalid UTF-8).
SNIFF_BYTES = 64 * 1024

#: Seconds of walking ``data.path`` folders after which one progress line is printed.
PROGRESS_AFTER_S = 5.0

#: Unreadable paths a refusal names before "and N more".
UNREADABLE_SHOWN = 3

# stat errors of a link that leads nowhere (missing target, a loop): a broken link in a
# folder is skipped, as before; any other error (EACCES) is an unreadable entry.
_BROKEN_LINK_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})


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


def not_text(path: str | pathlib.Path) -> str | None:
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




class Files:
    """``data.path``'s files in concatenation order, a sequence of ``(key, pathlib.Path)``,
    each judged UTF-8 text (:func:`not_text`) at most once, when first asked.

    ``entries`` holds ``(key, path as str)`` (a ``Path`` is built only for an item asked
    for: 100k of them cost seconds), ``ids`` the files' ``(st_dev, st_ino)``, the key of
    the verdicts. ``judged`` counts the files opened to be judged. With ``judge=False``
    every file counts as text (the default corpus's ``.py`` files are not judged).
    """

    def __init__(self, entries: list[tuple[str, str]], ids: list[tuple[int, int]] | None = None,
                 judge: bool = True) -> None:
        self.entries = entries
        self.ids = ids if ids is not None else [(0, i) for i in range(len(entries))]
        self.judge = judge
        self.judged = 0
        self._verdict: dict[tuple[int, int], bool] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> tuple[str, pathlib.Path]:
        key, path = self.entries[i]
        return key, pathlib.Path(path)

    def __iter__(self) -> Iterator[tuple[str, pathlib.Path]]:
        return (self[i] for i in range(len(self)))

    def judge_path(self, path: str | pathlib.Path, ident: tuple[int, int]) -> bool:
        """Whether the regular file ``path`` (``(st_dev, st_ino)`` ``ident``) is UTF-8
        text; a file that cannot be read is not. Opens it the first time only."""
        if not self.judge:
            return True
        if ident not in self._verdict:
            self.judged += 1
            try:
                self._verdict[ident] = not_text(path) is None
            except OSError:
                self._verdict[ident] = False
        return self._verdict[ident]

    def is_text(self, i: int) -> bool:
        """Whether entry ``i`` is UTF-8 text (:meth:`judge_path`)."""
        return self.judge_path(self.entries[i][1], self.ids[i])


class _Progress:
    """One ``hdet-train: reading data.path: N files so far...`` line on stderr, once a
    walk has taken :data:`PROGRESS_AFTER_S`; only where ``RANK`` is unset or 0."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.files = 0
        self.shown = os.environ.get("RANK", "0") not in ("", "0")

    def count(self) -> None:
        self.files += 1
        if not self.shown and time.monotonic() - self.start >= PROGRESS_AFTER_S:
            self.shown = True
            print(f"hdet-train: reading data.path: {self.files} files so far...", file=sys.stderr, flush=True)


_Found = list[tuple[str, str, tuple[int, int], str]]
#: ``(relative posix path, path, errno, is a folder)`` of what a folder walk could not read.
_Unreadable = list[tuple[str, str, int, bool]]


def _readable(path: str) -> bool:
    """Whether this process may open ``path`` for reading (``access``, with the effective
    ids ``open`` uses where the platform can): one syscall, no open."""
    return os.access(path, os.R_OK, effective_ids=os.access in os.supports_effective_ids)


def _refuse_pseudo(full: str, real: str) -> None:
    pseudo = next((r for r in PSEUDO_ROOTS if real == r or real.startswith(r + "/")), None)
    if pseudo is not None:
        raise HDETConfigError(f"data.path: the folder {full!r} inside data.path is {real!r}, in {pseudo}, a kernel "
                              "pseudo-filesystem whose files describe the running system: data.path takes text "
                              "files or folders of them; remove the link or name the folders to read")


def _walk(top: str, rel_top: str, real_top: str, walked: set[tuple[int, int]], found: _Found,
          links: list[tuple[str, str]], progress: _Progress, unreadable: _Unreadable) -> None:
    """Add the regular non-hidden files under ``top`` to ``found``, descending into its
    folders but not its linked ones, which are added to ``links``; the files and folders
    this process may not read go to ``unreadable``."""
    stack = [(top, rel_top, real_top)]
    while stack:
        dirpath, rel_dir, real_dir = stack.pop()
        try:
            with os.scandir(dirpath) as it:
                names = sorted((e.name, e.is_symlink()) for e in it if not e.name.startswith("."))
        except OSError as e:
            # a folder's unreadable files and folders must not be left out without a word
            unreadable.append((rel_dir, dirpath, e.errno or errno.EACCES, True))
            continue
        subdirs = []
        for name, linked in names:
            full = os.path.join(dirpath, name)
            rel = f"{rel_dir}/{name}" if rel_dir else name
            try:
                # stat before open: a FIFO or device is skipped without being opened
                st = os.stat(full)
            except OSError as e:
                if e.errno not in _BROKEN_LINK_ERRNOS:  # EACCES: a folder we may list but not search
                    unreadable.append((rel, full, e.errno or errno.EACCES, False))
                continue
            ident = (st.st_dev, st.st_ino)
            if stat.S_ISDIR(st.st_mode) and linked:
                links.append((rel, full))
            elif stat.S_ISDIR(st.st_mode) and ident not in walked:  # walked: a bind mount
                walked.add(ident)
                _refuse_pseudo(full, os.path.join(real_dir, name))
                subdirs.append((full, rel, os.path.join(real_dir, name)))
            elif stat.S_ISREG(st.st_mode):
                progress.count()
                if not _readable(full):  # files chmod 000 must not be dropped without a word
                    unreadable.append((rel, full, errno.EACCES, False))
                    continue
                found.append((rel, full, ident,
                              os.path.realpath(full) if linked else os.path.join(real_dir, name)))
        stack.extend(reversed(subdirs))


def _folder_files(folder: pathlib.Path, progress: _Progress, ident: tuple[int, int], part: str = "",
                  run_dir: str | None = None) -> _Found:
    """Regular, non-hidden files under ``folder`` (``(st_dev, st_ino)`` ``ident``) as
    ``(relative posix path, path, (st_dev, st_ino), real path)`` (strings but the
    identity), sorted by relative path; not judged text here.

    Linked folders are followed, after all the folders that are not links (so a folder
    also reached through a link keeps its own path), in sorted order of their paths,
    round by round; a folder already walked (the same ``st_dev``/``st_ino``, e.g. a link
    to an ancestor) is not walked again, so every walk ends. Broken links are skipped.

    Raises:
        HDETConfigError: a folder met inside ``folder`` (a link to it, or to ``/``) whose
            real path is in /proc or /sys; files or folders inside it that this process
            may not read (:func:`_refuse_unreadable`, naming ``part``, the item of
            ``data.path``); a linked folder that is ``run_dir``, lies inside it or holds
            it (else found only at the resume, once run_dir holds files).
    """
    found: _Found = []
    walked = {ident}
    links: list[tuple[str, str]] = []
    unreadable: _Unreadable = []
    _walk(str(folder), "", os.path.realpath(folder), walked, found, links, progress, unreadable)
    while links:
        pending, links = sorted(links), []
        for rel, full in pending:
            try:
                st = os.stat(full)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in walked:
                walked.add((st.st_dev, st.st_ino))
                real = os.path.realpath(full)
                _refuse_pseudo(full, real)
                refuse_link_to_run_dir(full, real, run_dir)
                _walk(full, rel, real, walked, found, links, progress, unreadable)
    if unreadable:
        _refuse_unreadable(part or str(folder), unreadable)
    found.sort(key=lambda item: item[0])
    return found


def _refuse_unreadable(part: str, unreadable: _Unreadable) -> None:
    """Refuse folder ``part`` of ``data.path`` for its unreadable files and folders: how
    many, the first :data:`UNREADABLE_SHOWN` paths (sorted), the OS's reason and the fix.
    Training on the rest would train on part of the corpus without a word (e.g. 16 of
    28 files ``chmod 000``: 42% of the corpus)."""
    unreadable = sorted(unreadable)
    if unreadable[0][0] == "":  # the folder named itself: one line, as for a file named directly
        raise HDETConfigError(f"data.path: folder {part!r} cannot be read: {os.strerror(unreadable[0][2])}")
    folders = sum(1 for *_, is_dir in unreadable if is_dir)
    files = len(unreadable) - folders
    what = " and ".join(f"{n} {noun}{'s' if n > 1 else ''}" for n, noun in ((files, "file"), (folders, "folder")) if n)
    shown = ", ".join(repr(full) for _, full, _, _ in unreadable[:UNREADABLE_SHOWN])
    more = f" and {len(unreadable) - UNREADABLE_SHOWN} more" if len(unreadable) > UNREADABLE_SHOWN else ""
    reasons = sorted({os.strerror(code) for _, _, code, _ in unreadable})
    raise HDETConfigError(f"data.path: {what} in folder {part!r} cannot be read ({', '.join(reasons)}): "
                          f"{shown}{more}; make them readable by this user (chmod, or ask their owner), or name "
                          "only the readable files or subfolders in data.path (comma-separated)")


def _comma_note(raw: list[str], index: int) -> str:
    """For ``data.path`` item ``raw[index]`` that names nothing: the path with a comma that
    it and its neighbours name together (up to 16 items), if one exists."""
    for width in range(min(len(raw), 16), 1, -1):
        for a in range(max(0, index - width + 1), min(index, len(raw) - width) + 1):
            joined = ",".join(raw[a : a + width]).strip()
            if os.path.lexists(os.path.expanduser(joined)):
                return (f"; data.path is a comma-separated list, and {joined!r} (a path with a comma) cannot be "
                        "given: rename it or link it under a name without a comma")
    return ""


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


def collect(path: str, run_dir: str | None = None) -> tuple[Files, str]:
    """Resolve ``data.path`` into ``(files, source)``: the candidate files in
    concatenation order (:class:`Files`, judged text only when read) and the paths as given.

    Each comma-separated item is a file, whose key is its name, or a folder, whose regular
    non-hidden files (linked files and folders followed, :func:`_folder_files`) are keyed
    by their path relative to it, in sorted order; when several items add files, each key is
    prefixed by the item's place among those (``"1:"``). A file reached twice (the same real
    path: through links, a folder named twice, a file of a folder named before) keeps its
    first place only, and an item that adds no file changes no key: the split is then the
    one without it.

    Raises:
        HDETConfigError: naming the part of ``data.path`` that names nothing (and the path
            with a comma it may be part of), a broken link, a path in /proc or /sys,
            something other than a regular file or folder (a device such as
            ``/dev/null``, a FIFO, a socket), an unreadable or non-text file, a folder
            holding files or folders this process may not read (how many, the first
            paths, the reason), or a folder without any text file (its files are opened
            until one is text), or a file whose real path is inside ``run_dir`` (reached
            through a link).
    """
    raw = path.split(",")
    parts = [p.strip() for p in raw if p.strip()]
    if parts and len(parts) != len(raw):
        # "a,,b" and "a," would read as "a,b" and "a" without a word
        whole = os.path.lexists(os.path.expanduser(path.strip()))
        raise HDETConfigError(f"data.path={path!r} has an empty item between its commas: give each path once, "
                              "separated by single commas" + (" (a path with commas cannot be given: rename it or "
                                                              "link it under a name without a comma)" if whole else ""))
    if not parts:
        raise HDETConfigError(f"data.path={path!r} names no path: give a text file or folder, or leave data.path "
                              "out (or null) to train on the built-in corpus (the Python standard library's sources)")
    files = Files([], [])
    inside = os.path.realpath(os.path.expanduser(run_dir)).rstrip(os.sep) + os.sep if run_dir else None
    seen: set[str] = set()  # real paths: a file reached through links is read once (hard links: each)
    progress = _Progress()
    added: list[list[tuple[str, str, tuple[int, int]]]] = []  # per item: the files it adds
    for index, part in enumerate(parts):
        p = pathlib.Path(part).expanduser()
        try:
            st = os.stat(p)
        except FileNotFoundError:
            if os.path.islink(p):
                raise HDETConfigError(f"data.path: {part!r} is a broken symbolic link (to "
                                      f"{os.readlink(p)!r}, which does not exist)") from None
            raise HDETConfigError(f"data.path: {part!r} does not exist"
                                  f"{_comma_note(raw, index) or relative_note(part)}") from None
        except OSError as e:
            raise HDETConfigError(f"data.path: {part!r} cannot be read: {e.strerror or e}") from None
        pseudo = _pseudo_root(p)
        if pseudo is not None:
            raise HDETConfigError(f"data.path: {part!r} is in {pseudo}, a kernel pseudo-filesystem whose files "
                                  "describe the running system and change while it runs: data.path takes text "
                                  "files or folders of them")
        if stat.S_ISDIR(st.st_mode):
            members = _folder_files(p, progress, (st.st_dev, st.st_ino), part, run_dir)
            if not any(files.judge_path(full, ident) for _, full, ident, _ in members):
                raise HDETConfigError(f"data.path: folder {part!r} contains no readable, non-hidden UTF-8 text "
                                      "files")
            entries = members
        elif stat.S_ISREG(st.st_mode):
            _one_file(part, p)
            files._verdict[(st.st_dev, st.st_ino)] = True
            entries = [(p.name, str(p), (st.st_dev, st.st_ino), os.path.realpath(p))]
        else:
            raise HDETConfigError(f"data.path: {part!r} is not a regular file but a {file_kind(st.st_mode)}: "
                                  "data.path takes text files or folders of them")
        new: list[tuple[str, str, tuple[int, int]]] = []
        for key, full, ident, real in entries:
            if inside is not None and real.startswith(inside):
                # check_apart compares data.path's own parts; a link in a data folder into
                # run_dir would make the run's files training data all the same
                raise HDETConfigError(f"data.path: {full!r} leads into run_dir {run_dir!r} (real path {real!r}): "
                                      "the run's own files (metrics, checkpoints) would be read as training data; "
                                      "remove the link or put run_dir elsewhere")
            if real not in seen:
                seen.add(real)
                new.append((key, full, ident))
        added.append(new)
    # Keys are prefixed by the item's place among the items that add files, when several
    # do, so that equal relative paths under different folders hash differently. An item
    # that adds nothing (a repeat, a file of an earlier folder) changes no key, hence not
    # the split (data.path=docs,docs must not move files between the splits).
    adding = [item for item in added if item]
    for place, item in enumerate(adding):
        prefix = f"{place}:" if len(adding) > 1 else ""
        for key, full, ident in item:
            files.entries.append((prefix + key, full))
            files.ids.append(ident)
    return files, ",".join(parts)
