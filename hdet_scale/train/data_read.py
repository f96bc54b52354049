"""Reading the corpus's files into a train and a validation split, for
:func:`hdet_scale.train.data.load_corpus`.

Only the files that are read are opened: a file of a ``data.path`` folder is judged text
(:meth:`hdet_scale.train.data_files.Files.is_text`) when the reading comes to it, so a
folder of 100k files costs a walk and ``data.max_bytes``, not 100k opens (judging first,
``data.path=/usr`` takes 42 s before anything is printed). The result is the one of
judging every file first: the same files, order and split.
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Iterable

from hdet_scale.errors import HDETConfigError
from hdet_scale.train.data_files import Files

#: Separator written between concatenated files.
SEPARATOR = b"\n"


def hash_unit(key: str, seed: int) -> float:
    """Stable hash of ``(seed, key)`` mapped to [0, 1)."""
    return zlib.crc32(f"{seed}\x1f{key}".encode("utf-8", "surrogateescape")) / 2**32


def at_most(fh: Any, n: int) -> int:
    """``n``, or the bytes left in the open file if fewer: ``read(n)`` allocates ``n`` up
    front, so a ``data.max_bytes`` meaning "everything" (1e10, 2**63) would raise
    MemoryError or OverflowError."""
    return max(0, min(n, os.fstat(fh.fileno()).st_size - fh.tell()))


def _fill(files: Files, order: Iterable[int], budget: int) -> tuple[list[bytes], bool]:
    """Read the text files among ``files[i] for i in order`` until ``budget`` bytes
    (separators included) are reached. Returns the chunks and whether a text file (empty
    ones included) was among those examined: when it is False, every one was examined."""
    chunks: list[bytes] = []
    used = 0
    found = False
    for i in order:
        if used >= budget:
            break
        if not files.is_text(i):
            continue
        found = True
        try:
            with open(files.entries[i][1], "rb") as fh:
                raw = fh.read(at_most(fh, budget - used + 1))
        except OSError:
            continue
        if not raw:
            continue
        sep = len(SEPARATOR) if chunks else 0
        room = budget - used - sep
        if room <= 0:
            break
        raw = raw[:room]
        chunks.append(raw)
        used += sep + len(raw)
    return chunks, found


def _first_text(files: Files, order: Iterable[int]) -> int | None:
    return next((i for i in order if files.is_text(i)), None)


def read_splits(files: Files, val_fraction: float, max_bytes: int, seed: int,
                source: str = "") -> tuple[list[bytes], list[bytes]]:
    """The train and validation chunks (bytes of one file each, in order) of ``files``.

    Of the text files of ``files`` (all of them when none is judged), in order: with one,
    its first ``max_bytes`` bytes split by position (the last ``val_fraction`` part is
    validation); with more, a file goes to validation when ``hash_unit(key, seed) <
    val_fraction`` (if a split would have none, the file with the smallest (for
    validation) or largest (for train) ``(hash, key)`` is moved) and each split reads its
    files in order until its budget is full: train ``max(1, int(max_bytes * (1 -
    val_fraction)))`` bytes, validation the rest, counting a one-byte separator between
    files; the last file read is cut. Empty and unreadable files add nothing.

    Args:
        files: candidate files, judged text lazily; ``max_bytes`` >= 2 bytes;
            ``val_fraction`` in (0, 1); ``source`` names the data in messages.

    Raises:
        HDETConfigError: a single file that yields fewer than 2 bytes, or a split
            without a readable, non-empty file.
    """
    where = source or "data.path"
    first = _first_text(files, range(len(files)))
    if first is None:
        raise HDETConfigError(f"data.path: {where!r} yields no readable UTF-8 text file")
    if _first_text(files, range(first + 1, len(files))) is None:  # one text file: split by position
        full = files[first][1]
        try:
            with open(full, "rb") as fh:
                raw = fh.read(at_most(fh, max_bytes))
        except OSError as exc:
            raise HDETConfigError(f"data.path: cannot read {str(full)!r}: {exc}") from exc
        if len(raw) < 2:
            raise HDETConfigError(f"data.path: {where!r} yields {len(raw)} byte(s); need at least 2 to form "
                                  "a train and a validation split")
        n_val = min(len(raw) - 1, max(1, round(len(raw) * val_fraction)))
        return [raw[: len(raw) - n_val]], [raw[len(raw) - n_val:]]

    train_budget = max(1, int(max_bytes * (1.0 - val_fraction)))
    val_budget = max(1, max_bytes - train_budget)
    hashes = [hash_unit(key, seed) for key, _ in files.entries]
    val_set = [i for i in range(len(files)) if hashes[i] < val_fraction]
    train_set = [i for i in range(len(files)) if hashes[i] >= val_fraction]
    val_chunks, val_found = _fill(files, val_set, val_budget)
    train_chunks, train_found = _fill(files, train_set, train_budget)
    if not (val_found and train_found):  # with 2+ text files, one split has one
        by_hash = sorted(range(len(files)), key=lambda i: (hashes[i], files.entries[i][0]))
        if not val_found:  # no text file hashed to validation: the smallest-hash one moves there
            moved = _first_text(files, by_hash)
        else:  # all text files hashed to validation: the largest-hash one moves to train
            moved = _first_text(files, reversed(by_hash))
        val_chunks, _ = _fill(files, [i for i in val_set if i != moved] + ([moved] if not val_found else []),
                              val_budget)
        train_chunks, _ = _fill(files, [i for i in train_set if i != moved] + ([moved] if val_found else []),
                                train_budget)
    for name, chunks in (("train", train_chunks), ("validation", val_chunks)):
        if not chunks:  # one text file and an empty one must not read as a riddle
            texts = sum(files.is_text(i) for i in range(len(files)))
            raise HDETConfigError(f"data.path: {where!r} yields no readable, non-empty files for the {name} split: "
                                  f"its {texts} text files (empty ones included) are split by file, and every "
                                  f"non-empty one went to the other split; remove the empty or unreadable files "
                                  "(one text file is split by position) or add text files")
    return train_chunks, val_chunks
