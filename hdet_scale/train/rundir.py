"""How a run starts in its ``run_dir`` (fresh, resumed, or refused) and what a resumed run
keeps of the one that died. Its checkpoints during the run: ``run_checkpoint.py``.

A new run never destroys an earlier run in the same ``run_dir``: :func:`start_mode`
resumes it (``train.resume=true``, or automatically when ``torchrun`` restarted this same
job), or refuses and names ``train.overwrite``, the key that allows a fresh start. Every
rank reaches the same verdict from the same files and environment, before any
collective; only rank 0 changes the folder afterwards (:func:`prepare_run_dir`), and never
in a way that turns another rank's "resume" into something else.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile

from hdet_scale.safe_parse import json_load, json_loads  # deep nesting is a ValueError
from hdet_scale.backends.checkpoint_io import LATEST_FILE, LAYOUT_FILE, read_latest, write_atomic
from hdet_scale.errors import HDETConfigError
from hdet_scale.train import resume_config
from hdet_scale.train.no_latest import no_latest_message, tag_index
from hdet_scale.train.run_dir_place import PROBE_PREFIX, refuse_root
from hdet_scale.paths import refuse_kernel_fs
from hdet_scale.train.run_lock import LOCK_FILE, check_not_in_use, hold_run_dir  # noqa: F401 (re-exported)

RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoint")
JOB_FILE = "job.json"  # which torchrun job (TORCHELASTIC_RUN_ID) last started in this run_dir


def checkpoint_dir(run: dict) -> str:
    return os.path.join(run["run_dir"], "checkpoint")


def _restart_count() -> int:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def restarted_job(run_dir: str) -> bool:
    """Whether this process is a ``torchrun`` restart (``TORCHELASTIC_RESTART_COUNT`` > 0)
    of the job that wrote ``run_dir/job.json`` (same ``TORCHELASTIC_RUN_ID``, torchrun's
    ``--rdzv-id``; a random one under ``--standalone``). An id of ``none`` (torchrun's
    default without ``--rdzv-id``) identifies no job: then nothing is automatic."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if _restart_count() == 0 or run_id in ("", "none"):
        return False
    try:
        with open(os.path.join(run_dir, JOB_FILE)) as f:
            return json_load(f).get("torchelastic_run_id") == run_id
    except (OSError, ValueError):
        return False


def restart_line(run: dict, start: str) -> str | None:
    """What this start does with an earlier run in ``run_dir`` (``start``: its
    :func:`start_mode`), in one line for rank 0 to print: the checkpoint a resume loads
    (``train.resume=true``: nothing else names it), or what a torchrun
    restart of this job does. ``None`` for a fresh or replacing start of the user's own."""
    resumed = start == "resume" and run["train"]["resume"]
    if not resumed and not restarted_job(run["run_dir"]):
        return None
    tag = read_latest(checkpoint_dir(run)) or "?"
    where = os.path.join(checkpoint_dir(run), "replica_*", tag)
    index = tag_index(checkpoint_dir(run), tag)
    step = index.get(tag)  # the step the save recorded, whatever the tag's name
    if step is not None:
        where += f" (the state after optimizer step {step})"
    if resumed:  # the tag latest names: not always the newest (a user may point it back)
        newer = [f"{t} (step {s})" for t, s in index.items() if step is not None and isinstance(s, int) and s > step]
        # a resume from a checkpoint latest was pointed back to replaces the newer ones as
        # it saves: said, not silent
        later = (f"; newer checkpoint(s) {', '.join(newer)} are replaced or removed as this run saves (copy "
                 "checkpoint/ first to keep them)" if newer else "")
        return f"train.resume: resuming from the checkpoint checkpoint/latest names, {where}{later}"
    k = _restart_count()
    if start == "resume":
        return f"torchrun restart {k}: resuming from the newest checkpoint, {where}"
    return f"torchrun restart {k}: the failed attempt saved no checkpoint; starting over (its files replaced)"


def _why_no_checkpoint(held: list[str], run_dir: str) -> str:
    """Why a run whose files ``held`` (of :data:`RUN_FILES`) lack ``checkpoint/`` has none:
    a ``summary.json`` is written only when a run completes (a completed
    ``train.checkpoint=false`` run is not said to have stopped before its first save), and says whether
    it saved a final checkpoint (``checkpointed``: a deleted ``checkpoint/`` is not put
    down to ``train.checkpoint=false``). Never raises."""
    if "summary.json" not in held:
        return "it stopped before its first save; train.checkpoint_every=N saves every N steps"
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            saved = json_load(f).get("checkpointed")
    except (OSError, ValueError, AttributeError):
        saved = None
    if saved is False:
        return "it completed with train.checkpoint=false, which saves none"
    if saved is True:
        return f"it completed and saved a checkpoint, but {os.path.join(run_dir, 'checkpoint')} is gone: moved or deleted"
    return ("it completed, and its checkpoint/ folder is not there: deleted or moved, or the run had "
            "train.checkpoint=false")


def start_mode(run: dict) -> str:
    """``"resume"`` (from ``checkpoint/latest``: ``train.resume=true``, or a torchrun
    restart of this job), ``"replace"`` (``run_dir`` holds files this run may replace:
    ``train.overwrite=true``, or the same job's crashed attempt from before its first
    checkpoint) or ``"fresh"``. Reads files only; the same on every rank.

    Raises:
        HDETConfigError: ``run_dir`` holds another run and neither resuming nor
            ``train.overwrite`` applies (the message names both keys); ``train.resume``
            with a ``checkpoint/`` folder that has no ``latest`` (never a silent restart
            from step 0: the message names the folder, the complete checkpoints its
            index lists, and the ways on), or with a run that has no checkpoint at all
            and no ``train.overwrite``.
    """
    run_dir, t = run["run_dir"], run["train"]
    _check_kinds(run_dir)
    _refuse_inside_a_checkpoint(run_dir)
    if os.path.exists(os.path.join(run_dir, LAYOUT_FILE)) and not os.path.exists(os.path.join(run_dir, "checkpoint")):
        # run_dir=<run>/checkpoint (the Hugging Face habit of naming the checkpoint
        # folder) would train from step 0 into the other run's checkpoint folder
        parent = os.path.dirname(os.path.abspath(run_dir.rstrip(os.sep)))
        raise HDETConfigError(f"run_dir: {run_dir} is a checkpoint folder (it holds {LAYOUT_FILE}); give the run's "
                              f"own folder, run_dir={parent}" + (" (with train.resume=true to continue it)"
                                                                   if not t["resume"] else ""))
    ckpt = checkpoint_dir(run)
    has_latest = os.path.exists(os.path.join(ckpt, LATEST_FILE))
    auto = restarted_job(run_dir)
    if (t["resume"] or auto) and has_latest:
        return "resume"
    if t["overwrite"] or auto:
        _refuse_runs_in(ckpt)  # the more precise message first
    _refuse_foreign_files(ckpt)  # every way on from here may remove checkpoint/
    if auto:
        return "replace"
    held = [n for n in RUN_FILES if os.path.exists(os.path.join(run_dir, n))]
    if t["resume"] and os.path.isdir(ckpt):
        raise HDETConfigError(no_latest_message(ckpt, t["steps"]))
    if t["resume"] and held and not t["overwrite"]:
        raise HDETConfigError(f"train.resume: {run_dir} holds a run ({', '.join(held)}) but no checkpoint to resume "
                              f"from ({_why_no_checkpoint(held, run_dir)}): start it over with train.resume=false "
                              "train.overwrite=true, or choose another run_dir")
    if held and not t["overwrite"]:
        # no checkpoint/ at all (has_latest is False here): a resume is no way on
        resume = ("continue it with train.resume=true (needs its checkpoint/latest), " if os.path.isdir(ckpt) else
                  f"it has no checkpoint to resume from ({_why_no_checkpoint(held, run_dir)}); ")
        raise HDETConfigError(f"run_dir: {run_dir} already holds a run ({', '.join(held)}); {resume}choose another "
                              "run_dir, or set train.overwrite=true to replace it")
    if not held and not t["overwrite"] and t.get("plots", True):
        _refuse_plots_in_the_way(run_dir)
    return "replace" if held else "fresh"


def _refuse_inside_a_checkpoint(run_dir: str) -> None:
    """Refuse a ``run_dir`` inside another run's ``checkpoint/`` folder (accepted, it would
    be removed with everything in it, its lock held or not, by ``train.overwrite=true``
    on the outer run). Compared by real path.

    Raises:
        HDETConfigError: naming the outer run and the way out.
    """
    path = os.path.realpath(os.path.expanduser(run_dir))
    parent = os.path.dirname(path)
    while parent != path:
        path, parent = parent, os.path.dirname(parent)
        if os.path.basename(path) == "checkpoint" and any(
                os.path.exists(os.path.join(parent, n)) for n in ("metrics.jsonl", "summary.json")):
            raise HDETConfigError(f"run_dir: {run_dir} is inside {path}, the checkpoint folder of the run in "
                                  f"{parent}, which that run's train.overwrite=true removes with everything in it; "
                                  "choose a run_dir outside it")


# What hdet-train writes at the top of checkpoint/ (checkpoint_io: the index, the tag
# pointer, the settings record, one folder per replica, write_atomic's temporaries).
_OWN_CHECKPOINT_ENTRY = re.compile(r"(latest|hdet_layout\.json|hdet_run_config\.json|replica_\d+)(\.tmp\d+)?")


def _refuse_foreign_files(ckpt: str) -> None:
    """Refuse a ``checkpoint/`` folder holding files hdet-train does not write (a user's
    ``checkpoint/my_model.bin`` would be called "a run" and then removed by
    ``train.overwrite=true``). Only the folder's top level is judged: the replica
    folders below are hdet-train's. A link is removed as a link (:func:`_remove`).

    Raises:
        HDETConfigError: naming the folder, up to 5 of the files, and the ways on.
    """
    if not os.path.isdir(ckpt) or os.path.islink(ckpt):
        return
    foreign = sorted(n for n in os.listdir(ckpt) if not _OWN_CHECKPOINT_ENTRY.fullmatch(n))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise HDETConfigError(f"run_dir: {ckpt} holds files hdet-train did not write ({shown}); hdet-train keeps "
                              "its checkpoints there and removes the folder when a run is replaced "
                              "(train.overwrite=true): move those files out of it, or choose another run_dir")


def _refuse_runs_in(ckpt: str) -> None:
    """Before ``train.overwrite=true`` removes ``ckpt``: refuse when another run's folder
    lies inside it (its ``metrics.jsonl`` or its lock; put there before the check above
    existed, or by hand), naming it: that run is the user's, not this run's to remove."""
    if not os.path.isdir(ckpt) or os.path.islink(ckpt):
        return  # a link is removed as a link (_remove)
    for folder, dirs, files in os.walk(ckpt):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        if "metrics.jsonl" in files or LOCK_FILE in files:
            raise HDETConfigError(f"train.overwrite: {ckpt}, which it removes, holds another run's folder "
                                  f"({folder}); move that run out of it first, or choose another run_dir")


def _refuse_plots_in_the_way(run_dir: str) -> None:
    """A new run in a ``run_dir`` whose ``plots`` folder already holds files of the names
    the run gives its plots at the end, other than the plots its record
    (``plot_out.RECORD``) lists as drawn from this run_dir's metrics (a user's own
    ``plots/loss.png`` would be replaced without a word; ``hdet-plot`` refuses the same
    folder)."""
    from hdet_scale.plot_out import plot_files, read_record

    folder = os.path.join(run_dir, "plots")
    found = plot_files(folder)
    record = read_record(folder) if found else None
    if record and record["metrics"] == os.path.realpath(os.path.join(run_dir, "metrics.jsonl")):
        found = [n for n in found if n not in record["pngs"]]  # an earlier run's plots here, recorded as such
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise HDETConfigError(f"run_dir: {folder} already holds {shown}, of the names this run gives its plots at "
                              "its end (it would replace them): move them away, choose another run_dir, set "
                              "train.plots=false, or train.overwrite=true to replace them")


def _check_kinds(run_dir: str) -> None:
    """The run's own names in ``run_dir`` are of the kind the run writes (files, the
    ``checkpoint`` folder): anything else there fails only when a rank writes it."""
    for name in (*RUN_FILES, JOB_FILE, LOCK_FILE):
        path = os.path.join(run_dir, name)
        if not os.path.lexists(path):
            continue
        want_dir = name == "checkpoint"
        ok = os.path.isdir(path) if want_dir else os.path.isfile(path)
        if not ok:
            what = "a folder" if want_dir else "a file"
            raise HDETConfigError(f"run_dir: {path} is not {what}, which the run writes there; move it away or "
                                  "choose another run_dir")


def check_writable(run_dir: str, key: str = "run_dir") -> None:
    """Create ``run_dir`` if needed and write (then remove) a probe file in it, so that an
    unwritable folder is named before any rank starts, not found by four ranks at once.
    ``key``: the config key the folder comes from, for the message (``wandb.dir`` too).

    Raises:
        HDETConfigError: ``run_dir`` is not a folder, or cannot be created or written (the reason
            and path).
    """
    broken = _broken_link(run_dir)
    if broken is not None:
        raise HDETConfigError(f"{key}: {broken} is a symbolic link to {os.readlink(broken)!r}, which does not "
                              f"exist; create its target, remove the link, or choose another {key}")
    refuse_root(run_dir, key)  # run_dir=/ would train and write among the system's folders
    refuse_kernel_fs(run_dir, key)
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        # makedirs would say only "File exists" (run_dir=afile, run_dir=/dev/null)
        if os.path.isfile(run_dir):
            raise HDETConfigError(f"{key}: {run_dir} is a file, not a folder: choose another {key}, or move the "
                                  "file away")
        # a device, a pipe, a socket: never advise moving /dev/null away
        raise HDETConfigError(f"{key}: {run_dir} is not a folder: choose another {key}")
    try:
        os.makedirs(run_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=run_dir)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and os.path.abspath(e.filename) != os.path.abspath(run_dir) else ""
        raise HDETConfigError(f"{key}: cannot write to {run_dir}: {e.strerror or e}{where}; choose a folder this "
                              "user can create and write") from None


def _broken_link(path: str) -> str | None:
    """The first component of ``path`` that is a symbolic link to nothing (makedirs would
    report it only as "File exists"), or ``None``."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        sub = os.sep.join(parts[:i]) or os.sep
        if os.path.islink(sub) and not os.path.exists(sub):
            return sub
        if not os.path.lexists(sub):
            return None
    return None


def truncate_metrics(path: str, step: int, every: int = 1) -> int:
    """Drop the records of ``path`` (JSONL) past optimizer step ``step`` (those of the run
    that died after its checkpoint), the end-of-run converge at ``step`` itself (a record
    with ``hdet/final_converge`` and no ``hdet/sync``: a run stopped before total_steps
    averaged after saving each replica, and the resume goes on from those, not from the
    average), the per-step record of ``step`` when ``logging.every`` (``every``) would not
    have written it (the stopped run's last step is always logged; kept, the resumed
    metrics would hold a record the uninterrupted run's lack), and a torn last
    line, atomically. Returns how many records were dropped."""
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    # Bytes that are not UTF-8 (a torn or damaged tail) become U+FFFD: such a line is no
    # JSON record and is dropped like a torn line, not a UnicodeDecodeError on every rank.
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json_loads(line)
            except ValueError:
                dropped += 1
                continue
            at = record.get("step")
            end_only = at == step and "hdet/sync" not in record and (
                "hdet/final_converge" in record or step % max(1, every) != 0)
            if at is not None and (at > step or end_only):
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    write_atomic(path, "".join(kept))
    return dropped


def prepare_run_dir(run: dict, mode: str) -> None:
    """Rank 0, after :func:`start_mode` and before the metrics logger opens its file: a
    replacing run removes the files of the run it replaces (an old ``checkpoint/latest``
    must never mix with the new run's). Records the torchrun job id (:data:`JOB_FILE`).
    A resumed run's files are trimmed only once its checkpoint has loaded
    (:func:`trim_for_resume`), so a resume that fails loses nothing."""
    run_dir = run["run_dir"]
    os.makedirs(run_dir, exist_ok=True)
    if mode == "replace":
        for name in RUN_FILES:
            _remove(os.path.join(run_dir, name))
        _remove_plots(run_dir)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id not in ("", "none"):
        write_atomic(os.path.join(run_dir, JOB_FILE), json.dumps({"torchelastic_run_id": run_id}))


def _remove_plots(run_dir: str) -> None:
    """The PNGs ``hdet-plot`` wrote into ``run_dir/plots`` (they would show the replaced
    run's curves); anything else a user put there stays, and so does the folder then."""
    folder = os.path.join(run_dir, "plots")
    if not os.path.isdir(folder) or os.path.islink(folder):
        return
    from hdet_scale.plot_out import PLOT_NAME, RECORD

    for name in os.listdir(folder):
        if PLOT_NAME.fullmatch(name) or name == RECORD:  # the PNGs and the record of whose they are
            _remove(os.path.join(folder, name))
    with contextlib.suppress(OSError):
        os.rmdir(folder)  # only when empty


def trim_for_resume(run: dict, step: int, every: int = 1) -> None:
    """Rank 0, after the checkpoint loaded and before the first new record: keep the
    metrics up to ``step``, the optimizer step the load restored (the scheduler's own,
    not ``hdet_layout.json``'s index: an index naming another step for the tag would
    leave the records of steps 21-25 twice), so ``metrics.jsonl`` reads like one
    uninterrupted run, and drop the stopped run's ``summary.json``. When the file holds
    no record of the last step ``every`` (``hdet.logging.every``) logs at or before
    ``step`` (deleted, or cut short by hand), a note on stderr names the steps whose
    records are gone: the resumed run appends after them (not a silent gap)."""
    run_dir = run["run_dir"]
    path = os.path.join(run_dir, "metrics.jsonl")
    truncate_metrics(path, step, every)
    _remove(os.path.join(run_dir, "summary.json"))
    expected = step - step % max(1, every)
    last = last_record_step(path)
    if expected > 0 and (last is None or last < expected):
        held = "no record" if last is None else f"records up to step {last} only"
        print(f"hdet-train: note: {path} holds {held}, though the checkpoint is at step {step}: the records of "
              f"steps {1 if last is None else last + 1}-{step} are gone, and the resumed run appends from step "
              f"{step + 1} on", file=sys.stderr, flush=True)


def last_record_step(path: str) -> int | None:
    """The largest ``step`` of the records in the JSONL ``path`` (``None``: no file, or no
    record with an integer step)."""
    if not os.path.exists(path):
        return None
    last = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                at = json_loads(line).get("step")
            except (ValueError, AttributeError):
                continue
            if isinstance(at, int) and (last is None or at > last):
                last = at
    return last


def _remove(path: str) -> None:
    if os.path.islink(path):
        # a link in the run_dir (rmtree would raise on every start): remove the
        # link, never what it points at, which may be another run's
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def saved_wandb_run_id(run: dict) -> str | None:
    """The W&B run id the checkpoint ``latest`` names was saved with (``None``: none
    recorded, W&B off then, or a user's own run)."""
    return resume_config.saved_wandb_run_id(checkpoint_dir(run))


def check_resume_config(run: dict) -> list[str]:
    """``resume_config.check`` for this run's checkpoint: raises HDETStateError for a
    change since the checkpoint that cannot work (a model shape, ...); returns the other
    changes. Reads files only, the same on every rank."""
    return resume_config.check(run, checkpoint_dir(run))


def resume_notice(run: dict, data: dict | None = None) -> str | None:
    """The warning that a resumed run's settings changed since its checkpoint (every key,
    ``old -> new``, and the value used; ``data``: this run's ``data.fingerprint``, told
    when the bytes trained on changed), or ``None``: also when this run does not resume.
    Raises what :func:`start_mode` and :func:`check_resume_config` raise."""
    if start_mode(run) != "resume":
        return None
    return resume_config.notice(run, checkpoint_dir(run), data)
