"""The bookkeeping of a checkpoint folder, so that a crash at any moment leaves ``latest``
naming a complete checkpoint, and the per-rank RNG state a checkpoint carries.

A folder holds ``replica_<r>/<tag>/...`` (the engines' files, one folder per replica and
tag), ``hdet_layout.json`` and ``latest`` (the tag to resume from). The layout's
``"checkpoints"`` entry is the *index*: ``{tag: optimizer step}`` of the complete
checkpoints, oldest first; its ``"step"`` is the step of the newest save. A save
(``checkpoints.checkpoint_target`` ... ``checkpoints.finish_checkpoint``) runs:

1. rank 0 *retires* the tag (:func:`retire_tag`): a tag saved before is dropped from the
   index, ``latest`` moved off it first, and any folder of that tag (complete, or partial
   from a crash) removed, so no stale file survives into the new save. Barrier.
2. every rank writes its files into ``replica_<r>/<tag>``.
3. a barrier proves every rank wrote; rank 0 then :func:`commit` s: the layout with the tag
   added to the index, then ``latest``, each a temp file + ``os.replace`` (atomic on
   POSIX: a reader sees the old file or the new one, never a torn one). Barrier.
4. optionally :func:`prune_checkpoints` (after ``latest`` moved): keep the newest N.

A crash between the two replaces of step 3 leaves ``latest`` on the previous (complete)
checkpoint while the layout's ``"step"`` is already the new one; readers therefore take
the step of the tag ``latest`` names from the index (:func:`latest_step`).

Rank 0 removes every replica's folders: this assumes one filesystem seen by all ranks,
as resuming a multi-replica checkpoint does anyway (``checkpoints.check_resumable``).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import warnings
import zipfile
import zlib
from typing import Any

import torch
import torch.distributed as dist

from hdet_scale.processes import pid_alive
from hdet_scale.safe_parse import json_load  # deep nesting is a ValueError

LAYOUT_FILE = "hdet_layout.json"
LATEST_FILE = "latest"
# The default tag (``global_step<step>``): only folders named so are removed as crash leftovers.
DEFAULT_TAG = re.compile(r"global_step\d+")


def remove_stale_temps(path: str) -> list[str]:
    """Remove the temp files :func:`write_atomic` left for ``path`` (``<path>.tmp<pid>``)
    whose process is gone (a rank stopped by a signal mid-write ends with ``os._exit``) or
    is this one. A live process's temp file, mid-write, is kept. Returns the paths removed;
    never raises."""
    folder, name = os.path.split(path)
    pattern = re.compile(re.escape(name) + r"\.tmp(\d+)")
    removed = []
    try:
        entries = os.listdir(folder or ".")
    except OSError:
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry)
        if m and (int(m.group(1)) == os.getpid() or not pid_alive(int(m.group(1)))):
            try:
                os.remove(os.path.join(folder, entry))
                removed.append(os.path.join(folder, entry))
            except OSError:
                pass
    return removed


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder and ``os.replace``;
    first removes the temp files an earlier write of ``path`` left (:func:`remove_stale_temps`)."""
    remove_stale_temps(path)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_latest(save_dir: str) -> str | None:
    """The tag in ``save_dir/latest``, or ``None`` when there is none."""
    path = os.path.join(save_dir, LATEST_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def _read_layout(save_dir: str) -> dict[str, Any]:
    path = os.path.join(save_dir, LAYOUT_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json_load(f)


def checkpoint_index(layout: dict[str, Any], latest: str | None) -> dict[str, int]:
    """``{tag: step}`` of the complete checkpoints, oldest first. A layout written before
    the index existed (hdet_scale <= 0.2) knows only ``latest`` at its ``"step"``."""
    if "checkpoints" in layout:
        return dict(layout["checkpoints"])
    return {latest: layout["step"]} if latest is not None and "step" in layout else {}


def manifested(layout: dict[str, Any]) -> list[str]:
    """The tags of ``layout``'s index saved with a manifest (hdet_scale >= 0.4 writes
    one for every save; older layouts list none)."""
    tags = layout.get("manifests")
    return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []


def latest_step(layout: dict[str, Any], latest: str | None) -> int | None:
    """The optimizer step of the checkpoint ``latest`` names (the layout's ``"step"`` when
    the index does not list it)."""
    return checkpoint_index(layout, latest).get(latest, layout.get("step"))


def _remove_tag_folders(save_dir: str, replicas: int, tag: str) -> None:
    for r in range(replicas):
        shutil.rmtree(os.path.join(save_dir, f"replica_{r}", tag), ignore_errors=True)


def retire_tag(save_dir: str, replicas: int, tag: str) -> None:
    """Rank 0, before a save under ``tag``: take ``tag`` out of the index (``latest``
    first moved to the newest other complete checkpoint, or removed when there is none)
    and remove its folders. No step leaves ``latest`` naming a folder being removed."""
    layout, latest = _read_layout(save_dir), read_latest(save_dir)
    index = checkpoint_index(layout, latest)
    if tag in index:
        del index[tag]
        if latest == tag:
            if index:
                write_atomic(os.path.join(save_dir, LATEST_FILE), list(index)[-1])
            else:
                os.remove(os.path.join(save_dir, LATEST_FILE))
        layout["checkpoints"] = index
        write_atomic(os.path.join(save_dir, LAYOUT_FILE), json.dumps(layout))
    _remove_tag_folders(save_dir, replicas, tag)


def commit(save_dir: str, layout: dict[str, Any], tag: str) -> None:
    """Rank 0, after every rank wrote its files for ``tag``: the layout (``layout``, whose
    ``"step"`` is the save's step, plus the index with ``tag`` added), then ``latest``."""
    previous = _read_layout(save_dir)
    index = checkpoint_index(previous, read_latest(save_dir))
    index.pop(tag, None)
    index[tag] = layout["step"]
    # which tags were saved with a manifest: a load then refuses a folder that lost its
    # manifest, rather than falling back to the weaker archive check (manifest.py)
    manifests = [t for t in manifested(previous) if t in index and t != tag] + [tag]
    write_atomic(os.path.join(save_dir, LAYOUT_FILE),
                 json.dumps({**layout, "checkpoints": index, "manifests": manifests}))
    write_atomic(os.path.join(save_dir, LATEST_FILE), tag)


def prune(save_dir: str, replicas: int, keep: int) -> list[str]:
    """Rank 0: remove all but the newest ``keep`` (>= 1) checkpoints of the index, and
    folders named ``global_step<N>`` that the index does not list (saves cut short by a
    crash). Never the one ``latest`` names. Returns the tags removed."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    layout, latest = _read_layout(save_dir), read_latest(save_dir)
    index = checkpoint_index(layout, latest)
    drop = [t for t in list(index)[:-keep] if t != latest]
    if drop:
        layout["checkpoints"] = {t: s for t, s in index.items() if t not in drop}
        layout["manifests"] = [t for t in manifested(layout) if t not in drop]
        write_atomic(os.path.join(save_dir, LAYOUT_FILE), json.dumps(layout))
    leftovers = set()
    for r in range(replicas):
        rdir = os.path.join(save_dir, f"replica_{r}")
        if os.path.isdir(rdir):
            leftovers |= {n for n in os.listdir(rdir) if DEFAULT_TAG.fullmatch(n) and n not in index}
    for tag in drop + sorted(leftovers):
        _remove_tag_folders(save_dir, replicas, tag)
    return drop + sorted(leftovers)


def prune_checkpoints(save_dir: str, topology: Any, keep: int | None) -> None:
    """Keep the newest ``keep`` complete checkpoints in ``save_dir`` (:func:`prune`);
    ``None`` keeps all. Call it after a backend's ``save_checkpoint`` returned (``latest``
    has moved). Collective: every rank calls it (rank 0 removes, then a world barrier)."""
    if keep is None:
        return
    if topology.rank == 0:
        prune(save_dir, topology.replicas, keep)
    dist.barrier(group=topology.world_group)


# ---- integrity ------------------------------------------------------------------------
# A file cut short (a full disk, a copy interrupted, a node lost while it wrote) is found
# before a resume starts, without loading it: torch.save writes a zip archive whose
# directory is at the end, and DCP's .metadata records every .distcp file's extent.

_ZIP_MAGIC = b"PK\x03\x04"


def damaged_files(folder: str) -> list[str]:
    """Problems with the files of one checkpoint folder (``replica_<r>/<tag>``), each
    ``"<path>: <what>"``; empty when none is found. Checks, reading only headers and
    directories: no file is empty; a ``torch.save`` archive (zip; DeepSpeed's
    ``*_model_states.pt`` / ``*_optim_states.pt``, DDP's ``model_optim.pt``, fairscale's
    and HDET's ``.pt``) has its directory, so it was not cut short; a DCP checkpoint's
    (FSDP2) ``.metadata`` reads, and each ``.distcp`` file it names is as long as it
    records. Files in other formats are only checked for being non-empty."""
    problems = []
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        size = os.path.getsize(path)
        if size == 0:
            problems.append(f"{path}: empty (0 bytes)")
            continue
        with open(path, "rb") as f:
            head = f.read(4)
        # a .distcp file concatenates items, some of them torch.save archives: its extent is
        # checked against .metadata below, never as one archive
        if head == _ZIP_MAGIC and not name.endswith(".distcp"):
            try:
                zipfile.ZipFile(path).close()
            except (zipfile.BadZipFile, OSError, ValueError):
                problems.append(f"{path}: truncated or damaged ({size} bytes; a torch.save archive without its "
                                "directory at the end)")
    if ".metadata" in names and not problems:
        problems += _damaged_dcp(folder)
    return problems


def _damaged_dcp(folder: str) -> list[str]:
    from hdet_scale.backends.safe_load import dcp_metadata
    from hdet_scale.errors import HDETUntrustedFileError

    try:
        storage = dcp_metadata(folder).storage_data or {}
    except HDETUntrustedFileError:
        raise  # every rank reads the same .metadata here, before any collective: all refuse alike
    except Exception as e:  # unpickling a damaged file raises anything
        return [f"{os.path.join(folder, '.metadata')}: unreadable ({type(e).__name__}: {e})"]
    need: dict[str, int] = {}
    for info in storage.values():  # per item: relative_path, offset, length (bytes)
        try:
            end = int(info.offset) + int(info.length)
            need[info.relative_path] = max(need.get(info.relative_path, 0), end)
        except (AttributeError, TypeError, ValueError):
            return []  # a layout this check does not know: leave it to the load
    problems = []
    for rel, end in sorted(need.items()):
        path = os.path.join(folder, rel)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size is None:
            problems.append(f"{path}: missing (named by .metadata)")
        elif size < end:
            problems.append(f"{path}: truncated ({size} bytes; .metadata records {end})")
    return problems

# ---- checksums ------------------------------------------------------------------------
# Bytes changed inside a file of the right size (a bad disk block, a copy tool's bug) pass
# the checks above and may even load: a weight tensor reads as NaN, an RNG state as
# another. Every member of a torch.save archive carries a CRC-32 in its zip header, so a
# load first reads each file of the checkpoint once against them.

def damaged_file(folder: str, part: int = 0, parts: int = 1) -> str | None:
    """The first file in ``folder`` whose ``torch.save`` archive fails its own check, with
    why (``"<path> (<reason>)"``), or ``None``. Each member of the archive is read against the
    CRC-32 its zip header records (``zipfile.testzip``: streamed, a member at a time, so
    memory stays bounded); a DCP ``.distcp`` file holds one such archive per item, at the
    offsets its ``.metadata`` lists. With ``parts > 1`` only the files ``part, part +
    parts, ...`` of the sorted listing are read (each rank of a shard group its share)."""
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    slices: dict[str, list[tuple[int, int]]] = {}
    if ".metadata" in names:
        from hdet_scale.backends.safe_load import dcp_metadata
        from hdet_scale.errors import HDETUntrustedFileError

        try:
            storage = dcp_metadata(folder).storage_data or {}
            for info in storage.values():
                if not getattr(info, "transform_descriptors", None):  # compressed: not a plain archive
                    slices.setdefault(info.relative_path, []).append((info.offset, info.length))
        except HDETUntrustedFileError:
            return None  # not damage: safe_load.folder_problem names it, on the rank whose share holds it
        except Exception as e:  # noqa: BLE001 - an unreadable .metadata is the damaged file
            return f"{os.path.join(folder, '.metadata')} (unreadable: {type(e).__name__})"
    for name in names[part::parts]:
        file = os.path.join(folder, name)
        try:
            if name in slices:
                with open(file, "rb") as f:
                    for offset, length in sorted(slices[name]):
                        f.seek(offset)
                        bad = _bad_member(io.BytesIO(f.read(length)))
                        if bad:
                            return f"{file} ({bad} at offset {offset})"
            elif name.endswith(".pt") and zipfile.is_zipfile(file):
                bad = _bad_member(file)
                if bad:
                    return f"{file} ({bad})"
        except OSError as e:
            return f"{file} ({e.strerror or e})"
    return None


def _bad_member(archive: Any) -> str | None:
    try:
        with zipfile.ZipFile(archive) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, ValueError, EOFError, NotImplementedError, zlib.error) as e:
        return f"not a readable archive: {e}"
    return f"member {bad} fails its CRC check" if bad else None


def verify_checksums(load_dir: str, tag: str, topology: Any) -> None:
    """Before a load: every file of this replica's folder ``replica_<r>/<tag>`` read once,
    the files split over the shard group's ranks (the checkpoint is read once more in
    all, spread over every rank), and compared with the size and CRC-32 the save recorded
    in the folder's manifest (``manifest.py``: a file replaced, swapped or changed is
    found); a folder without a manifest is checked against its archives' own CRC-32s
    (:func:`damaged_file`: changed bytes only). Collective on the world group (every rank
    calls it), so all ranks raise alike rather than some entering the load's collectives.

    Each rank also reads its share through ``safe_load.folder_problem`` (the pickles
    parsed by a loader that runs no code, tensor bytes memory-mapped, not read).

    Raises:
        HDETStateError: a file fails its check; the message names it and why.
        HDETUntrustedFileError: every file passes its check, and one names code to run
            on load (a crafted file comes with a manifest that matches it).
    """
    from hdet_scale.backends.manifest import manifest_problem
    from hdet_scale.backends.safe_load import folder_problem
    from hdet_scale.errors import HDETStateError, HDETUntrustedFileError

    folder = os.path.join(load_dir, f"replica_{topology.replica_index}", tag)
    mine, has_manifest = manifest_problem(folder, topology.shard_index, topology.shard_size)
    if not has_manifest:  # saved before manifests (check_resumable refused a lost one)
        if topology.rank == 0:
            warnings.warn(f"checkpoint {load_dir} at tag {tag!r} was saved without file manifests (an older "
                          "hdet_scale): a file swapped or copied in from another save cannot be told from the "
                          "right one; only damaged bytes are checked", stacklevel=2)
        mine = damaged_file(folder, topology.shard_index, topology.shard_size)
    # The same share of files read once more, by a loader that runs no code (safe_load):
    # a crafted file arrives with a manifest that matches it, and the engines unpickle theirs.
    unsafe = folder_problem(folder, topology.shard_index, topology.shard_size)
    found: list[tuple[str | None, str | None]] = [(None, None)] * topology.world_size
    dist.all_gather_object(found, (unsafe, mine), group=topology.world_group)
    # damage first: a file that is not what the save wrote is named as such, whatever its
    # pickle holds; a crafted file with a matching manifest passes that and is refused here
    bad = [f for _, f in found if f]
    if bad:
        raise HDETStateError(f"checkpoint {load_dir} at tag {tag!r} has a damaged file: {bad[0]}. Restore it from a "
                             "copy, resume from an older checkpoint by writing its tag into "
                             f"{os.path.join(load_dir, LATEST_FILE)}, or start a new run_dir")
    refused = [u for u, _ in found if u]
    if refused:
        raise HDETUntrustedFileError(refused[0])

# ---- RNG ------------------------------------------------------------------------------
# Dropout draws from the process's global torch RNG; a resumed rank restores its own so
# its masks continue as if it had not stopped.

def rng_state() -> dict[str, Any]:
    """This process's torch RNG: CPU, and the current CUDA device's once CUDA is in use."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (the CUDA part only when CUDA is there)."""
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
