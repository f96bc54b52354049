"""What ``train.resume`` says of a ``checkpoint/`` folder without ``latest`` (never a
silent restart from step 0, ``rundir.start_mode``): the complete checkpoints its
``hdet_layout.json`` lists, or the tag folders on disk when that file is gone, and the
ways on that keep them. Reads files only; never raises."""

from __future__ import annotations

import os

from hdet_scale.backends.checkpoint_io import LATEST_FILE, LAYOUT_FILE, checkpoint_index
from hdet_scale.safe_parse import json_load


def tag_index(ckpt: str, latest: str | None) -> dict:
    """``ckpt``'s index of complete checkpoints ``{tag: step}`` (``checkpoint_index``);
    ``{}`` when its layout cannot be read. For messages: never raises."""
    try:
        with open(os.path.join(ckpt, LAYOUT_FILE)) as f:
            return checkpoint_index(json_load(f), latest)
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def no_latest_message(ckpt: str, steps: int | None = None) -> str:
    """Why ``train.resume`` cannot continue from ``ckpt`` (a folder without ``latest``),
    and the ways on: the complete checkpoints the layout's index lists, if any (the newest
    at ``steps``, this run's ``train.steps``, is a finished run's: said so)."""
    index = tag_index(ckpt, None)
    msg = (f"train.resume: {ckpt} has no {LATEST_FILE} file, which names the checkpoint to resume from (a save "
           "was cut short before its first checkpoint completed, or the file was removed). ")
    if index:
        tag = list(index)[-1]
        listed = ", ".join(f"{t} (step {s})" for t, s in index.items())
        msg += (f"Its {LAYOUT_FILE} lists complete checkpoint(s) {listed}: to resume from the newest, write its tag "
                f"into it (echo {tag} > {os.path.join(ckpt, LATEST_FILE)}). ")
        if isinstance(steps, int) and index[tag] >= steps:
            # the resume advice alone would lead to "nothing is left to do"
            msg += (f"That checkpoint is at train.steps={steps}: the run it belongs to finished its training, and a "
                    "resume from it trains only with a larger train.steps (up to the schedule's length). ")
    elif on_disk := tag_folders(ckpt):
        # with the layout emptied too, the one way named must not be the overwrite that
        # deletes these folders
        layout = os.path.join(ckpt, LAYOUT_FILE)
        why = "is missing" if not os.path.lexists(layout) else "cannot be read (damaged?)"
        msg += (f"It holds checkpoint folder(s) {', '.join(on_disk)}, but its {LAYOUT_FILE}, which lists the "
                f"complete ones, {why}: restore {layout} from a copy, then write the newest complete tag into "
                f"{LATEST_FILE} (echo {on_disk[-1]} > {os.path.join(ckpt, LATEST_FILE)}). ")
        return msg + ("To start over (this deletes those folders), set train.resume=false train.overwrite=true; or "
                      "choose another run_dir")
    return msg + ("To start over, set train.resume=false train.overwrite=true (removes it); or choose another "
                  "run_dir")


def tag_folders(ckpt: str) -> list[str]:
    """The checkpoint tag folders inside ``ckpt``'s ``replica_*`` folders, by step
    (``global_step<N>``), complete or not: for messages. Never raises."""
    tags: set[str] = set()
    try:
        for replica in os.listdir(ckpt):
            folder = os.path.join(ckpt, replica)
            if replica.startswith("replica_") and os.path.isdir(folder):
                tags.update(t for t in os.listdir(folder) if os.path.isdir(os.path.join(folder, t)))
    except OSError:
        pass

    def step(tag: str) -> tuple[int, str]:
        digits = tag.removeprefix("global_step")
        return (int(digits) if digits.isdigit() else -1, tag)

    return sorted(tags, key=step)
