"""The checkpoint layout every backend shares: ``<dir>/replica_<r>/<tag>/...`` (replica r's
files), ``hdet_layout.json`` and ``latest``; the start of a save (``checkpoint_target``),
its end (``finish_checkpoint``), the structural check a resume runs before any rank starts
(``check_resumable``) and the scheduler's own state file. Split from ``backends/common.py``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hdet_scale.safe_parse import json_load  # deep nesting is a ValueError
from hdet_scale.backends.checkpoint_io import (DEFAULT_TAG, LATEST_FILE, LAYOUT_FILE, checkpoint_index, commit,
                                               damaged_files, latest_step, manifested, read_latest, retire_tag,
                                               rng_state, set_rng_state)
from hdet_scale.backends.manifest import listing_problem, write_manifest
from hdet_scale.backends.safe_load import load as safe_load
from hdet_scale.ensemble import HDETScheduler
from hdet_scale.errors import HDETStateError
from hdet_scale.topology import Topology

# Every backend writes <dir>/replica_<r>/<tag>/... (replica r's files), an
# hdet_layout.json and a "latest" file; replicas differ between syncs, so each has its own
# folder and no two ranks write one file.

def replica_dir(save_dir: str, topology: Topology, tag: str) -> str:
    return os.path.join(save_dir, f"replica_{topology.replica_index}", tag)


#: Names the checkpoint folders use for their own files: not a tag.
_RESERVED = (LATEST_FILE, LAYOUT_FILE, "zero_to_fp32.py", "zero_to_torch.py")


def check_tag(tag: Any) -> None:
    """Refuse a checkpoint tag that is not one plain folder name: each replica saves into
    ``replica_<r>/<tag>``, so a tag with ``/`` or ``..`` would put every replica into one
    folder, each overwriting the others' files, and the load would then contradict
    itself. Also refused: an empty tag, ``.``, whitespace at either end or a
    line break (``latest`` holds the tag as one line of text), and the names of the
    folders' own files (``latest``, ``hdet_layout.json``, DeepSpeed's recovery scripts,
    ``.hdet*``).

    Raises:
        HDETStateError: naming the tag and what a tag may be.
    """
    if not isinstance(tag, str) or not tag or tag in (".", "..") or "/" in tag or os.sep in tag \
            or tag != tag.strip() or any(c in tag for c in "\n\r\0"):
        raise HDETStateError(f"checkpoint tag {tag!r}: a tag is one folder name (each replica saves into "
                             "replica_<r>/<tag>): no '/', not '.' or '..', no whitespace at its ends or line "
                             "break; e.g. global_step100, or leave tag=None for global_step<step>")
    if tag in _RESERVED or tag.startswith(".hdet"):
        # "latest" is the name of DeepSpeed's link in each replica folder
        # (and its tools' file), the others files of the checkpoint folder itself
        raise HDETStateError(f"checkpoint tag {tag!r}: a name the checkpoint folder uses for its own files "
                             f"({', '.join(_RESERVED)}); e.g. global_step100, or leave tag=None for "
                             "global_step<step>")


def check_save_dir(save_dir: Any) -> None:
    """Refuse a ``save_dir`` that cannot become a folder: a path that is a file, a path
    under a file, or a folder this process may not write into (its nearest existing
    ancestor's permissions), where every rank would otherwise raise ``NotADirectoryError``
    from ``os.makedirs``. Local, before any collective.

    Raises:
        HDETStateError: naming ``save_dir`` and what is in the way.
    """
    path = os.path.abspath(os.fspath(save_dir))
    probe = path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is" if probe == path else f"is under {probe}, which is"
        raise HDETStateError(f"checkpoint folder {save_dir!r} {where} a file, not a folder: save into a folder "
                             "(each replica writes replica_<r>/<tag>/ inside it)")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise HDETStateError(f"checkpoint folder {save_dir!r}: {probe} is not writable by this process; save "
                             "into a folder you may write")


def checkpoint_target(scheduler: HDETScheduler, save_dir: str, tag: str | None) -> tuple[Topology, str, str]:
    """``(topology, tag, replica folder)`` for a save; creates the folder. The default tag
    is ``global_step<step>``. A folder already there for the tag (a save cut short by a
    crash, or an earlier save under the same tag) is removed first, and ``latest`` moved
    off it (``checkpoint_io.retire_tag``). Collective (one barrier on the world group):
    every rank calls it at the start of a save.

    Raises:
        ValueError: the scheduler has no process groups (not built by a backend).
        HDETStateError: ``tag`` is not one plain folder name (:func:`check_tag`), or
            ``save_dir`` cannot be a folder (:func:`check_save_dir`), before any collective.
    """
    t = scheduler.topology
    if t is None:
        raise ValueError("this scheduler has no process groups (not built by a backend's initialize): save "
                         "torch.save(scheduler.state_dict()) next to the model instead")
    if tag is not None:
        check_tag(tag)
    check_save_dir(save_dir)
    tag = tag or f"global_step{scheduler.step_count}"
    if t.rank == 0:
        retire_tag(save_dir, t.replicas, tag)
    dist.barrier(group=t.world_group)  # no rank writes into a folder being removed
    rdir = replica_dir(save_dir, t, tag)
    os.makedirs(rdir, exist_ok=True)
    return t, tag, rdir


def finish_checkpoint(save_dir: str, topology: Topology, scheduler: HDETScheduler, tag: str,
                      backend: str) -> None:
    """After every rank has written its files (the first barrier proves it): rank 0
    writes ``hdet_layout.json`` (with ``tag`` added to its index of complete checkpoints),
    then ``latest``, each atomically (``checkpoint_io.commit``): a crash at any point
    leaves ``latest`` naming a complete checkpoint. Before that, each replica folder's
    manifest (``manifest.write_manifest``: the files' sizes and CRC-32s, which a load
    compares). Collective (three barriers and one all_gather_object on the world group)."""
    dist.barrier(group=topology.world_group)
    write_manifest(save_dir, tag, topology)  # each replica folder's files, sizes and CRC-32s
    dist.barrier(group=topology.world_group)  # every manifest on disk before latest names the tag
    if topology.rank == 0:
        commit(save_dir, {"world_size": topology.world_size, "replicas": topology.replicas,
                          "shard_size": topology.shard_size, "step": scheduler.step_count,
                          "total_steps": scheduler.total_steps, "backend": backend}, tag)
    dist.barrier(group=topology.world_group)


def read_layout(load_dir: str) -> dict:
    """``hdet_layout.json`` of a checkpoint: world_size, replicas, shard_size, step (of
    the checkpoint ``latest`` names), total_steps, backend (absent in checkpoints of
    hdet_scale 0.1: DeepSpeed), checkpoints (``{tag: step}``, oldest first).

    Raises:
        HDETStateError: there is none, or it is not a JSON object (a file cut short or
            edited), or its step is not an integer; the message names the file.
    """
    path = os.path.join(load_dir, LAYOUT_FILE)
    if not os.path.isdir(load_dir):
        what = "is not a folder" if os.path.exists(load_dir) else "does not exist"
        raise HDETStateError(f"{load_dir} {what}: pass the folder save_checkpoint wrote (it holds {LAYOUT_FILE})")
    if not os.path.exists(path):
        raise HDETStateError(f"{load_dir} holds no hdet checkpoint (no {LAYOUT_FILE})")
    try:
        with open(path) as f:
            layout = json_load(f)
    except (ValueError, OSError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise HDETStateError(f"{path} is damaged (not JSON: {e}): restore it from a copy, or start a new "
                             "run_dir") from None

    if not isinstance(layout, dict):
        raise HDETStateError(f"{path} is damaged: it must hold a JSON object, got {json.dumps(layout)[:200]}: "
                             "restore it from a copy, or start a new run_dir")
    _require_ints(path, layout, ("step", "total_steps"), low=0, optional=True)
    try:
        tag = read_latest(load_dir)
        step = latest_step(layout, tag)
    except (ValueError, TypeError, AttributeError, OSError) as e:  # a damaged index or latest
        raise HDETStateError(f"{path} or {LATEST_FILE} next to it is damaged ({e})") from None
    named = int(tag.removeprefix("global_step")) if isinstance(tag, str) and DEFAULT_TAG.fullmatch(tag) else None
    if named is not None and tag in layout.get("checkpoints", {}) and step != named:  # a layout with the index
        # an edited index may say step 15 for global_step10; the engines restore the
        # step saved in the tag itself (10), so the resume line and the schedule would disagree
        raise HDETStateError(f"{path} is damaged: it lists {tag} (saved after optimizer step {named}) at step "
                             f"{step}: restore it from a copy, or start a new run_dir")
    return layout if step is None else {**layout, "step": step}


def _require_ints(path: str, layout: dict, keys: Sequence[str], low: int, optional: bool = False) -> None:
    bad = [k for k in keys if not (optional and layout.get(k) is None)
           and not (isinstance(layout.get(k), int) and not isinstance(layout.get(k), bool) and layout[k] >= low)]
    if bad:
        raise HDETStateError(f"{path} is damaged: {', '.join(bad)} must be integers >= {low}, got "
                             f"{json.dumps(layout)[:200]}: restore it from a copy, or start a new run_dir")


def check_resumable(load_dir: str, world_size: int, replicas: int, backend: str, tag: str | None = None) -> str:
    """Read the checkpoint's layout and tag without communication; returns the tag
    (``tag``, or the one in ``latest``). Every rank reads the same files (a shared
    filesystem, as for any multi-replica checkpoint), so all reach the same verdict
    before any collective.

    Raises:
        HDETStateError: missing checkpoint, written by another ``R x S`` layout or by
            another backend (each engine has its own file format), or a replica folder or
            a rank's HDET state file missing for the tag, or a file of the tag damaged
            (``checkpoint_io.damaged_files``: empty, cut short). Every replica's diverged weights are tied to its shard
            layout, so a different layout is refused rather than silently remapped; to
            change it, converge first and start a new run from the averaged model.
    """
    asked = tag is not None  # the caller's tag, not latest's: the message names what was asked
    if asked:
        check_tag(tag)
    saved = read_layout(load_dir)
    _require_ints(os.path.join(load_dir, LAYOUT_FILE), saved, ("replicas", "shard_size"), low=1)
    shard = world_size // replicas
    if saved["replicas"] != replicas or saved["shard_size"] != shard:
        raise HDETStateError(
            f"checkpoint {load_dir} was written by {saved['replicas']} replicas x {saved['shard_size']} shards; "
            f"this run has {replicas} x {shard}. Resume with the same world size and hdet.replicas")
    saved_backend = saved.get("backend", "deepspeed")
    if saved_backend != backend:
        raise HDETStateError(f"checkpoint {load_dir} was written by the {saved_backend} backend; this run uses "
                             f"{backend}. Resume with the same backend")
    if tag is None:
        tag = read_latest(load_dir)  # read_layout read it already: it is text
        if tag is None:
            raise HDETStateError(f"{os.path.join(load_dir, 'latest')} is missing or empty: it names the checkpoint "
                                 "to resume from (a tag, e.g. global_step100)")
    index = checkpoint_index(saved, None)
    if os.sep in tag or tag in (".", "..") or (saved.get("checkpoints") and tag not in index):
        listed = ", ".join(f"{t} (step {s})" for t, s in index.items()) or "none"
        if asked:  # a tag= never saved is not blamed on latest, which names another
            raise HDETStateError(f"checkpoint {load_dir} has no complete checkpoint tagged {tag!r} ({LAYOUT_FILE} "
                                 f"lists: {listed}); pass one of those tags, or leave tag unset to load the one in "
                                 "latest")
        raise HDETStateError(f"{os.path.join(load_dir, LATEST_FILE)} names {tag!r}, which {LAYOUT_FILE} does not list "
                             f"as a complete checkpoint of this folder (complete: {listed}); write one of those tags "
                             f"into it")
    missing = [r for r in range(replicas) if not os.path.isdir(os.path.join(load_dir, f"replica_{r}", tag))]
    if missing:  # a deleted folder: the older checkpoints may be whole
        raise HDETStateError(f"checkpoint {load_dir} has no folder for replica(s) {missing} at tag {tag!r}; "
                             f"{_ways_on(load_dir, saved, tag, replicas, shard)}")
    # Every rank writes one HDET state file: a partial save shows here, for all ranks alike.
    lost = _lost_state_files(load_dir, tag, replicas, shard)
    if lost:
        raise HDETStateError(f"checkpoint {load_dir} is incomplete: missing {', '.join(lost)}; "
                             f"{_ways_on(load_dir, saved, tag, replicas, shard)}")
    required = tag in manifested(saved)
    damaged = []
    for r in range(replicas):
        folder = os.path.join(load_dir, f"replica_{r}", tag)
        found = damaged_files(folder)  # "<path>: <what>"
        named = frozenset(os.path.join(folder, n) for n in os.listdir(folder)
                          if any(d.startswith(f"{os.path.join(folder, n)}: ") for d in found))
        damaged += found
        if (p := listing_problem(folder, required, named)) is not None:
            damaged.append(p)
    if damaged:
        raise HDETStateError(f"checkpoint {load_dir} at tag {tag!r} has damaged files: {'; '.join(damaged)}; "
                             f"{_ways_on(load_dir, saved, tag, replicas, shard)}")
    return tag


def _ways_on(load_dir: str, saved: dict, tag: str, replicas: int, shard: int) -> str:
    """The ways on from a damaged or incomplete checkpoint ``tag``: restore its files from
    a copy, resume from another checkpoint the layout ``saved`` lists whose replica
    folders and HDET state files are all there (with a replica folder gone from two
    tags, neither is offered as the way on from the other), or start a new run_dir
    (with no other checkpoint, not as "; or start a new run_dir" alone). Reads the
    folder listing only, not the files."""
    older = {t: s for t, s in checkpoint_index(saved, tag).items()
             if t != tag and not _lost_state_files(load_dir, t, replicas, shard)}
    listed = ", ".join(f"{t} (step {s})" for t, s in older.items())
    other = f"resume from another complete checkpoint by writing its tag into {LATEST_FILE} ({listed}), " if older else ""
    return f"restore them from a copy, {other}or start a new run_dir"


def _lost_state_files(load_dir: str, tag: str, replicas: int, shard: int) -> list[str]:
    """The HDET state files (every rank writes one, the last file of its save) that the
    folders of ``tag`` lack, as ``replica_<r>/<tag>/hdet_shard_<s>.pt``: a partial save, or
    a replica folder gone."""
    return [f"replica_{r}/{tag}/hdet_shard_{s}.pt" for r in range(replicas) for s in range(shard)
            if not os.path.exists(os.path.join(load_dir, f"replica_{r}", tag, f"hdet_shard_{s}.pt"))]


def _hdet_state_path(rdir: str, topology: Topology) -> str:
    return os.path.join(rdir, f"hdet_shard_{topology.shard_index}.pt")


def save_hdet_state(rdir: str, topology: Topology, scheduler: HDETScheduler, optimizer: Any = None) -> None:
    """This rank's scheduler state (with its interval-loss accumulator), torch RNG state
    (dropout: ``checkpoint_io.rng_state``) and the class name of the torch optimizer
    whose state the folder holds (``optimizer``; see :func:`check_optimizer_class`)
    into the replica folder ``rdir``, as ``hdet_shard_<s>.pt``."""
    state = {"scheduler": scheduler.state_dict(), "rng": rng_state()}
    if optimizer is not None:
        state["optimizer_class"] = type(optimizer).__name__
    torch.save(state, _hdet_state_path(rdir, topology))


def check_optimizer_class(rdir: str, topology: Topology, optimizer: Any) -> None:
    """Refuse, before anything is loaded, a checkpoint whose optimizer state was saved
    from another torch optimizer class than ``optimizer``'s (AdamW's state loaded into
    SGD makes the first step raise ``KeyError: 'momentum'``; Adam's
    into AdamW would load its groups' ``decoupled_weight_decay`` silently). Reads this
    rank's HDET state file only; every rank runs the same optimizer class and reads a
    file of the same save, so all reach one verdict. A checkpoint saved without the
    record (hdet_scale <= 0.4) is not checked.

    Raises:
        HDETStateError: the classes differ (both named, and what to do).
    """
    path = _hdet_state_path(rdir, topology)
    try:
        saved = load_entries(path, ("scheduler",)).get("optimizer_class")
    except HDETStateError:
        return  # another program's file in its place: the load names it, after the model's files
    mine = type(optimizer).__name__
    if saved is not None and saved != mine:
        raise HDETStateError(f"checkpoint {rdir}: its optimizer state was saved from torch {saved}, and this run's "
                             f"optimizer is {mine}: the state of one does not fit the other. Resume with {saved} "
                             "(the same optimizer as the saved run), or start a new run from the weights alone")


def load_entries(path: str, keys: tuple[str, ...], **load_kwargs: Any) -> dict:
    """``torch.load(path, weights_only=True, **load_kwargs)`` (``safe_load.load``: never
    runs code from the file), which must be a dict holding ``keys``: a file replaced by
    another archive (another backend's, another run's, an empty dict) is named, instead of
    a bare ``KeyError`` deep in a load.

    Raises:
        HDETUntrustedFileError: the file names code to run (``safe_load.load``).
        HDETStateError: the file holds something else (the path, the missing entries and
            the ones it has).
    """
    state = safe_load(path, **load_kwargs)
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if missing:
        has = sorted(map(str, state))[:10] if isinstance(state, dict) else type(state).__name__
        raise HDETStateError(f"checkpoint file {path} is not what this backend wrote there: no {missing} entry "
                             f"(it holds {has}); restore it from a copy, or resume from another checkpoint")
    return state


def load_hdet_state(rdir: str, topology: Topology, scheduler: HDETScheduler) -> None:
    """Restore what :func:`save_hdet_state` wrote; re-applies the current values and
    sets this process's torch RNG to the saved rank's (when the file has it), so dropout
    continues as if the run had not stopped. Backends call it last in a load."""
    state = load_entries(_hdet_state_path(rdir, topology), ("scheduler",))
    scheduler.load_state_dict(state["scheduler"])
    if "rng" in state:
        set_rng_state(state["rng"])
