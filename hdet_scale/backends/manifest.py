"""Each checkpoint folder's record of the files it saved: their sizes and CRC-32s.

The archives' own CRCs (``checkpoint_io.damaged_file``) find bytes changed inside a
file, but not a complete, undamaged file put in another file's place: two ranks' files
swapped, a file copied from an older checkpoint of the same run, another program's
archive. Each of those loads without an error and trains on wrong state. So a save
records, per replica folder ``replica_<r>/<tag>``, every file's size and CRC-32 in
``hdet_manifest.json`` (written by the replica's shard rank 0, atomically, before the
save is committed), and a load compares each file with it. Folders without one (saved
by hdet_scale 0.3 or earlier, or by hand) fall back to the archives' own CRCs.

Cost: one more read of each file at the save, just after it was written (the files
are split over the shard group's ranks, so the checkpoint is read once in all, most of
it from the page cache), and none extra at the load (the check the load runs anyway
reads each file once).
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import torch.distributed as dist

from hdet_scale.safe_parse import json_load  # deep nesting is a ValueError

MANIFEST_FILE = "hdet_manifest.json"
_CHUNK = 1 << 20  # bytes read at a time: memory stays bounded whatever the file's size


def digest(path: str) -> list[int]:
    """``[size in bytes, CRC-32]`` of the file at ``path``, streamed."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return [size, crc]


def write_manifest(save_dir: str, tag: str, topology: Any) -> None:
    """After every rank wrote its files into ``save_dir/replica_<r>/<tag>``: each rank
    digests its share of its replica's files (sorted, ``shard_index::shard_size``), the
    shares are gathered, and each replica's shard rank 0 writes the folder's manifest.
    Collective on the world group (every rank calls it, as ``finish_checkpoint`` does)."""
    from hdet_scale.backends.checkpoint_io import write_atomic

    folder = os.path.join(save_dir, f"replica_{topology.replica_index}", tag)
    names = sorted(n for n in os.listdir(folder) if n != MANIFEST_FILE and os.path.isfile(os.path.join(folder, n)))
    mine = {n: digest(os.path.join(folder, n)) for n in names[topology.shard_index::topology.shard_size]}
    gathered: list[Any] = [None] * topology.world_size
    dist.all_gather_object(gathered, (topology.replica_index, mine), group=topology.world_group)
    if topology.shard_index == 0:
        files: dict[str, list[int]] = {}
        for replica, share in gathered:
            if replica == topology.replica_index:
                files.update(share)
        # The folder's own place too: a whole folder copied in from another replica or tag
        # brings its manifest, and only these name it (else a resume can hang).
        write_atomic(os.path.join(folder, MANIFEST_FILE),
                     json.dumps({"files": files, "replica": topology.replica_index, "tag": tag}, sort_keys=True))


def manifest_problem(folder: str, part: int = 0, parts: int = 1) -> tuple[str | None, bool]:
    """``(problem, has_manifest)`` for the files ``part::parts`` of the sorted list in
    ``folder``'s manifest: the first one missing or differing from what the save recorded
    (``"<path> (<why>)"``), else ``None``; ``has_manifest`` False when the folder has
    none (then nothing was checked). An unreadable manifest is itself the problem."""
    path = os.path.join(folder, MANIFEST_FILE)
    if not os.path.isfile(path):
        return None, False
    try:
        expected = _read(path)
        listed = sorted(expected)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"{path} (unreadable: {type(e).__name__}: {e})", True
    for name in listed[part::parts]:
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            return f"{file} (missing: {MANIFEST_FILE} lists it)", True
        got = digest(file)
        if got != expected[name]:
            size, crc = expected[name]
            inside = _changed_inside(file)
            if inside:  # the archive's own check says more: bytes changed in place
                return f"{file} ({inside}; its bytes changed after it was written)", True
            return (f"{file} (not the file this checkpoint saved there: {got[0]} bytes, CRC-32 {got[1]:08x}; the save "
                    f"recorded {size} bytes, {crc:08x}: replaced, moved or changed since)"), True
    return None, True


def _read(path: str) -> dict[str, list[int]]:
    """``{file name: [size, CRC-32]}`` of the manifest at ``path``. Raises what reading or
    parsing raises (the callers name the file)."""
    with open(path) as f:
        files = json_load(f)["files"]
    return {n: [int(files[n][0]), int(files[n][1])] for n in sorted(files)}


def _place(path: str) -> tuple[str, str] | None:
    """``("replica_<r>", tag)`` the manifest at ``path`` was written for (``None``: a
    manifest of an older save, which did not record it)."""
    with open(path) as f:
        data = json_load(f)
    if "replica" not in data or "tag" not in data:
        return None
    return f"replica_{int(data['replica'])}", str(data["tag"])


def listing_problem(folder: str, required: bool, named: frozenset[str] = frozenset()) -> str | None:
    """The cheap part of the check, by ``stat`` alone, for the pre-start check
    (``checkpoints.check_resumable``, run by the launcher before any rank starts and by every
    rank before a load): the manifest is there when the save wrote one (``required``:
    ``hdet_layout.json`` lists the tag under ``"manifests"``), it reads, and every file
    it lists exists at the recorded size. ``"<path> (<why>)"`` for the first problem,
    else ``None``. The CRC-32s are compared by the load (:func:`manifest_problem`),
    which reads every file and so is split over the ranks. A file in ``named`` (paths
    another check already reported, e.g. a cut-short archive) is not named again (one
    file, one explanation)."""
    path = os.path.join(folder, MANIFEST_FILE)
    if not os.path.isfile(path):
        return (f"{path} (missing: this checkpoint was saved with one, and without it files swapped or copied "
                "in from another save cannot be found)") if required else None
    try:
        sizes = {n: v[0] for n, v in _read(path).items()}
        place = _place(path)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"{path} (unreadable: {type(e).__name__}: {e})"
    here = (os.path.basename(os.path.dirname(os.path.abspath(folder))), os.path.basename(os.path.abspath(folder)))
    if place is not None and place != here:
        return (f"{folder} (holds the files saved as {place[0]}/{place[1]}, not {here[0]}/{here[1]}: a folder copied "
                "in from another replica or checkpoint; each replica's state is its own)")
    for name, size in sizes.items():
        file = os.path.join(folder, name)
        if file in named:
            continue
        if not os.path.isfile(file):
            return f"{file} (missing: {MANIFEST_FILE} lists it)"
        if os.path.getsize(file) != size:
            return (f"{file} (not the file this checkpoint saved there: {os.path.getsize(file)} bytes; the save "
                    f"recorded {size}: replaced, cut short or changed since)")
    return None


def _changed_inside(file: str) -> str | None:
    """For a ``torch.save`` archive: the member whose own CRC-32 fails, if one does."""
    import zipfile

    from hdet_scale.backends.checkpoint_io import _bad_member

    if not file.endswith(".pt") or not zipfile.is_zipfile(file):
        return None
    return _bad_member(file)
