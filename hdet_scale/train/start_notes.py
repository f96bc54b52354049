"""What ``hdet-train`` prints before any rank starts, beside its own checks: one note per
``deepspeed`` key the chosen engine reads otherwise than DeepSpeed would, per setting that
never acts (``run_notes``), per key a new optimizer or schedule left out of the DeepSpeed
JSON, for a config file that sets nothing, for a run_dir of the user's own files
(``run_dir_place``); and a resumed run's one warning for settings and data changed since
its checkpoint, with the ``WANDB_RUN_ID`` note. Printed by the launcher, or by rank 0
under torchrun (``cli.py``). A note never stops a run."""

from __future__ import annotations

import sys
from typing import Any

from hdet_scale.errors import HDETConfigError, HDETStateError

UNREAD = object()


def yaml_top(path: str | None) -> Any:
    """The config file's top level as PyYAML reads it, for the notes below; ``UNREAD``
    when there is no file or it cannot be read (load_run_config read it already: a note is
    not worth an error)."""
    if path is None:
        return UNREAD
    try:
        from hdet_scale.safe_parse import yaml_load

        with open(path) as f:  # safe_parse: never a cyclic value for the checks
            return yaml_load(f.read())
    except Exception:  # noqa: BLE001 - see the docstring
        return UNREAD


def print_engine_notes(run: dict, path: str | None = None, overrides: list[str] | None = None) -> None:
    """One line on stderr for each ``deepspeed`` key the chosen engine reads otherwise
    than DeepSpeed would (``engines.engine_notes``), before any rank starts; for a
    config file ``path`` that sets nothing; for what the DeepSpeed JSON keeps under the
    overrides (a new ``optimizer.type``, a mapping override: read once, here)."""
    from hdet_scale.train.config import packaged
    from hdet_scale.train.config_files import load_deepspeed_json
    from hdet_scale.train.config_merge import kept_by_merge
    from hdet_scale.train.engines import engine_notes
    from hdet_scale.train.run_dir_place import foreign_files_note, kept_wandb_note
    from hdet_scale.train.run_notes import never_notes

    ds_path = run["deepspeed_config"] or packaged("deepspeed.json")
    shown = ds_path if run["deepspeed_config"] else "the packaged deepspeed.json"
    file_ds = load_deepspeed_json(ds_path)
    notes = (engine_notes(run["deepspeed"], run["backend"]) + switch_notes(run, file_ds) + never_notes(run)
             + kept_by_merge(overrides or [], file_ds, shown))
    place = [n for n in (foreign_files_note(run), kept_wandb_note(run)) if n]
    for note in empty_file_notes(path) + place + notes:
        print(f"hdet-train: note: {note}", file=sys.stderr, flush=True)


def empty_file_notes(path: str | None) -> list[str]:
    """A note for an empty or comments-only CONFIG.yaml (a truncated copy, the wrong
    file), which would otherwise run the packaged defaults without a word."""
    data = yaml_top(path)
    if data is UNREAD:
        return []
    if data not in (None, {}):
        return []
    return [f"config file {path!r} sets nothing ({'empty, or comments only' if data is None else 'an empty mapping'}): "
            "the run uses the packaged defaults and the key=value overrides"]


def switch_notes(run: dict, file_ds: dict | None = None) -> list[str]:
    """What a new ``optimizer.type`` left out of the DeepSpeed JSON's params, and a new
    ``hdet.schedule.name`` of its schedule keys (``optimizer_switch``); ``file_ds``: that
    JSON as read (read here if not given)."""
    from hdet_scale.train.config import packaged
    from hdet_scale.train.config_files import load_deepspeed_json
    from hdet_scale.train.optimizer_switch import schedule_switch_note, switch_note

    path = run["deepspeed_config"] or packaged("deepspeed.json")
    file_ds = load_deepspeed_json(path) if file_ds is None else file_ds
    name = path if run["deepspeed_config"] else "the packaged deepspeed.json"
    return [n for n in (switch_note(file_ds, run["deepspeed"], name),
                        schedule_switch_note(file_ds, run["deepspeed"], name)) if n]


def print_resume_notice(run: dict, checked: Any, quiet_errors: bool = False) -> None:
    """One warning on stderr when a resumed run's settings changed since its checkpoint
    (``resume_config.notice``: each key, old -> new, and the value the run uses; and
    whether the bytes of ``checked``'s corpus, ``validate``'s, differ from the
    checkpoint's); then the notes for W&B's variables (``run_notes.wandb_env_notes``).
    Under torchrun (``quiet_errors``) rank 0 prints it before ``train`` validates: a bad
    input is then left to ``train``, which names it on every rank alike."""
    from hdet_scale.train import resume_config, rundir
    from hdet_scale.train.data import fingerprint
    from hdet_scale.train.run_notes import wandb_env_notes

    try:
        resuming = rundir.start_mode(run) == "resume"
        note = resume_config.notice(run, rundir.checkpoint_dir(run), fingerprint(checked[1])) if resuming else None
    except (HDETConfigError, HDETStateError):
        if not quiet_errors:
            raise
        return
    if note:
        print(f"hdet-train: warning: {note}", file=sys.stderr, flush=True)
    for line in wandb_env_notes(run, resuming, rundir.saved_wandb_run_id(run) if resuming else None):
        print(f"hdet-train: note: {line}", file=sys.stderr, flush=True)
