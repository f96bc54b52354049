"""Where ``data.path`` lies relative to the run's own folders: a data folder that holds
``run_dir`` (or ``wandb.dir``) or lies inside it, or links into it, makes the run's own
files training data (a resume then trains on other bytes than the run it continues).
Compared by real path (links resolved). Reads paths only."""

from __future__ import annotations

import os

from hdet_scale.errors import HDETConfigError


def refuse_link_to_run_dir(full: str, real: str, run_dir: str | None) -> None:
    """Refuse a linked folder ``full`` (real path ``real``) of a data folder that leads
    into ``run_dir`` or holds it: the run's files would be training data (``data_files.collect``
    refuses the files themselves; at a fresh start run_dir has none yet)."""
    if run_dir is None:
        return
    own = os.path.realpath(os.path.expanduser(run_dir)).rstrip(os.sep) + os.sep
    linked = real.rstrip(os.sep) + os.sep
    if linked.startswith(own) or own.startswith(linked):
        how = "leads into" if linked.startswith(own) else "holds"
        raise HDETConfigError(f"data.path: {full!r} {how} run_dir {run_dir!r} (it links to {real!r}): the run's own "
                              "files (metrics, checkpoints) would be read as training data; remove the link or put "
                              "run_dir elsewhere")


def holding_part(path: str, folder: str) -> str | None:
    """The first comma-separated part of ``data.path`` that is ``folder`` or holds it
    (real paths, links resolved), or ``None``: a folder whose files would be read as
    training data. Never raises."""
    out = os.path.realpath(os.path.expanduser(folder))
    for part in (p.strip() for p in path.split(",") if p.strip()):
        real = os.path.realpath(os.path.expanduser(part))
        if out == real or out.startswith(real.rstrip(os.sep) + os.sep):
            return part
    return None


def check_apart(path: str | None, run_dir: str) -> None:
    """Refuse a ``data.path`` part that holds ``run_dir`` or lies inside it.

    A run_dir inside a data folder makes the run's own files (``metrics.jsonl``,
    checkpoints, ``latest``) training data: a resume then trains on other bytes than the
    run it continues, or is refused for a split that shrank ("data set too small: it
    has 13 bytes", the ``latest`` file). Data inside run_dir is removed by
    ``train.overwrite=true``. Compared by real path (links resolved).

    Raises:
        HDETConfigError: naming the part, run_dir and the way out.
    """
    if path is None:
        return
    out = os.path.realpath(os.path.expanduser(run_dir))
    if (part := holding_part(path, run_dir)) is not None:
        raise HDETConfigError(f"data.path: {part!r} holds run_dir {run_dir!r}: the run's own files (metrics, "
                              "checkpoints) would be read as training data, and a resume would train on other "
                              "data than the run it continues; put run_dir outside data.path")
    for part in (p.strip() for p in path.split(",") if p.strip()):
        real = os.path.realpath(os.path.expanduser(part))
        if real.startswith(out + os.sep):
            raise HDETConfigError(f"data.path: {part!r} is inside run_dir {run_dir!r}, whose contents belong to "
                                  "the run (train.overwrite=true removes them); keep the data outside run_dir")
