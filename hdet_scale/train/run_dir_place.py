"""Where a ``run_dir`` is, before anything is written to it: the
filesystem root is refused, and a folder that already holds the user's own files (and
no run of ours) gets one note naming what the run will write beside them. A folder of
config files is a fine run_dir, so nothing else is refused here. Split from
``rundir.py``: ``rundir.check_writable`` and ``validate`` call :func:`refuse_root`."""

from __future__ import annotations

import os

from hdet_scale.errors import HDETConfigError
from hdet_scale.train.run_lock import LOCK_FILE

PROBE_PREFIX = ".hdet_write_test."  # rundir.check_writable's probe file, removed at once
_SHOWN = 3  # entries named in the note; the count says how many there are


def refuse_root(path: str, key: str = "run_dir") -> None:
    """Refuse the filesystem root as ``key``'s folder (``/``, or a path or link that
    resolves to it): the run's files would land among the system's folders, and
    ``train.overwrite=true`` would remove its ``checkpoint/`` there.

    Raises:
        HDETConfigError: naming the key, the path and a folder to give instead.
    """
    real = os.path.realpath(os.path.expanduser(path))
    if real != os.path.realpath(os.sep):
        return
    shown = path if path == real else f"{path} (resolves to {real})"
    raise HDETConfigError(f"{key}: {shown} is the filesystem root: the run's files would be written among the "
                          f"system's folders; give a folder of the run's own, e.g. {key}=runs/my_run")


def writes(run: dict) -> list[str]:
    """The names this run writes into its run_dir, as its settings decide (``train.*``,
    W&B's folder when ``wandb.dir`` is not set)."""
    t, w = run["train"], run["wandb"]
    names = (["checkpoint/"] if t.get("checkpoint", True) else []) + (["plots/"] if t.get("plots", True) else [])
    names += ["metrics.jsonl", "summary.json", LOCK_FILE]
    return names + (["wandb/"] if w.get("enabled") and not w.get("dir") else [])


def foreign_entries(run_dir: str) -> list[str] | None:
    """The entries of ``run_dir`` that are not this start's own, sorted; ``None`` when it
    is not a readable folder or holds a run of ours (``rundir.RUN_FILES``: ``start_mode``
    refuses or replaces it). Not the user's: what a start itself may have put there before
    the note (the launcher holds the lock first; torchrun's rank 0 records its job)."""
    from hdet_scale.train.rundir import JOB_FILE, RUN_FILES  # rundir imports this module

    try:
        names = os.listdir(run_dir)
    except OSError:
        return None
    if any(n in names for n in RUN_FILES):
        return None
    return sorted(n for n in names if n not in (LOCK_FILE, JOB_FILE) and not n.startswith(PROBE_PREFIX)
                  and not (n == "wandb" and _wandb_folder(os.path.join(run_dir, n))))


_WANDB_NAMES = ("offline-run-", "run-", "latest-run", "debug")  # what W&B writes into its folder


def _wandb_folder(path: str) -> bool:
    """Whether ``path`` is a W&B folder (``run_dir/wandb``: only W&B's run folders, its
    ``latest-run`` link and debug logs): an earlier start's own, stopped before its first
    checkpoint (so that the restart the stop line advises is not told the run_dir holds
    the user's files)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return bool(names) and all(n.startswith(_WANDB_NAMES) for n in names)


def _listing(names: list[str]) -> tuple[int, str]:
    """``(how many, the first few joined, "..." when there are more)`` for a note."""
    return len(names), ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")


def foreign_files_note(run: dict) -> str | None:
    """One note when ``run_dir`` already holds entries of the user's and no run of ours
    (a run in a folder of one's own files would otherwise train and write beside them
    without a word), or ``None``. Printed once, before any rank starts
    (``start_notes.print_engine_notes``). Nothing of the user's is removed."""
    run_dir = run["run_dir"]
    entries = foreign_entries(run_dir)
    if not entries:
        return None
    n, shown = _listing(entries)
    return (f"run_dir: {run_dir} already holds {n} entr{'y' if n == 1 else 'ies'} ({shown}) and no earlier run "
            f"of hdet-train; this run writes {', '.join(writes(run))} beside {'it' if n == 1 else 'them'} (and "
            "removes none of them): give a new or empty run_dir to keep the run's files apart")


def kept_wandb_note(run: dict) -> str | None:
    """One note when ``train.overwrite=true`` replaces a run of ours whose W&B folder
    (``<wandb.dir or run_dir>/wandb``) holds run folders (``offline-run-*``, ``run-*``),
    or ``None`` (they are kept, beside the new run's: said, not silent).
    The replace removes the run's own files only (``rundir.RUN_FILES``, plots); W&B's
    stay, since an offline run not yet synced may be the only copy of its charts."""
    from hdet_scale.train.rundir import RUN_FILES  # rundir imports this module

    t, w = run["train"], run["wandb"]
    run_dir = run["run_dir"]
    if not t.get("overwrite") or t.get("resume"):
        return None
    try:
        if not any(n in os.listdir(run_dir) for n in RUN_FILES):
            return None
        folder = os.path.join(w.get("dir") or run_dir, "wandb")
        kept = sorted(n for n in os.listdir(folder) if n.startswith(("offline-run-", "run-")))
    except OSError:
        return None
    if not kept:
        return None
    n, shown = _listing(kept)
    return (f"train.overwrite=true replaces the run in {run_dir} (metrics.jsonl, summary.json, checkpoint/, plots/) "
            f"but keeps its W&B folder {folder}: {n} run folder{'' if n == 1 else 's'} ({shown}) of earlier runs "
            f"stay{'s' if n == 1 else ''} beside this run's; sync them (wandb sync {folder}/offline-run-*) or delete them")
