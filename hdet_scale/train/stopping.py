"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM: every rank ends, one line says what
happened and where the last checkpoint is, and the exit code is ``128 + signum`` (130,
143), the shell's convention.

A signal does not save: the run stops where it is, and ``run_dir/checkpoint/latest``
still names the newest *complete* checkpoint (saves are atomic, ``checkpoint_io``), even
when the signal came in the middle of a save; ``train.resume=true`` continues from it
exactly. Steps after it are lost (``train.checkpoint_every`` bounds how many).

- Local launcher (``hdet-train`` started bare, ``launcher.launch_local``): the ranks start
  with SIGINT ignored, so a Ctrl-C, which the terminal sends to every process of the job,
  is acted on by the launcher alone: it sends SIGTERM to every rank (default action: the
  rank ends at once, printing nothing; a rank holding a DeepSpeed op-build lock first
  removes it, ``startup.py``), SIGKILL after :data:`GRACE_S` to any rank still there (a
  second signal: at once), then prints :func:`stop_message`.
- Under ``torchrun`` (which forwards the signal it gets to every worker) or the
  ``deepspeed`` launcher: :func:`install_rank_handlers` makes each rank end on SIGINT or
  SIGTERM without a ``KeyboardInterrupt`` traceback, rank 0 printing the line.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from hdet_scale.safe_parse import json_load  # deep nesting is a ValueError
from hdet_scale.backends.checkpoint_io import LAYOUT_FILE, latest_step, read_latest

#: Seconds the launcher gives its ranks to end after SIGTERM before it kills them.
GRACE_S = 15.0
_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP (terminal closed)"}

# The optimizer step this attempt (this process, or the launcher's ranks) reached: the stop
# line names it, not the last record of metrics.jsonl, which an earlier, stopped attempt of
# a resumed run may have written before this one trained a step.
_step: int | None = None
_shared: Any = None  # the launcher's shared integer (multiprocessing.Value), in rank 0


def share_progress(value: Any) -> None:
    """Rank 0 of the local launcher: also write every :func:`note_step` into ``value``
    (a ``multiprocessing.Value("q")``), which the launcher reads when it stops the run."""
    global _shared
    _shared = value


def note_step(step: int) -> None:
    """The training loop, after each optimizer step: ``step`` optimizer steps are done."""
    global _step
    _step = step
    if _shared is not None:
        _shared.value = step


def attempt_step() -> int | None:
    """The last step :func:`note_step` got in this process, ``None`` before the first."""
    return _step


def exit_code(signum: int) -> int:
    """``128 + signum``: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP."""
    return 128 + int(signum)


def last_checkpoint(run_dir: str) -> tuple[str, int | None] | None:
    """``(folder of the checkpoint latest names, its optimizer step)`` of
    ``run_dir/checkpoint``, or ``None`` when it has no ``latest``. Never raises: the
    answer goes into a message."""
    ckpt = os.path.join(run_dir, "checkpoint")
    try:
        tag = read_latest(ckpt)
    except (OSError, UnicodeDecodeError):
        return None
    if tag is None:
        return None
    try:
        with open(os.path.join(ckpt, LAYOUT_FILE)) as f:
            step = latest_step(json_load(f), tag)
    except (OSError, ValueError, TypeError, AttributeError):
        step = None
    return os.path.join(ckpt, f"replica_*/{tag}"), step


def stop_message(signum: int, run: dict[str, Any], who: str, step: int | None) -> str:
    """The one line printed when ``signum`` stopped the run: ``who`` ended (e.g. "all 4
    ranks ended"), at which step (``step``: the last optimizer step this attempt completed,
    :func:`note_step`; ``None``: "before its first step"), and the checkpoint to resume
    from (or that there is none and what to do instead)."""
    at = f" at step {step}" if step is not None else " before its first step"
    head = f"hdet-train: stopped by {_NAMES.get(signum, signal.Signals(signum).name)}{at}; {who}."
    return f"{head} {resume_advice(run)}"


def failed_message(failure: str, run: dict[str, Any], step: int | None) -> str:
    """The line of rank 0 when torchrun's agent ended it because other ranks failed
    (``failure``: which, in words, noted by launchers/torchrun_quiet.py): what failed, the
    step this attempt reached, and what comes next: torchrun's restart, which resumes by
    itself, or (none left) the checkpoint to continue from. Never raises."""
    at = f" at step {step}" if step is not None else " before its first step"
    return f"hdet-train: torchrun ended every rank{at} after a failure ({failure}). {after_failure(run)}"


def after_failure(run: dict[str, Any]) -> str:
    """What comes after a failure: under ``torchrun`` with restarts left, the restart (which
    resumes by itself); otherwise :func:`resume_advice` (a rank that lost its peer must not
    advise train.overwrite=true beside the agent's "restarts the job"). Never raises."""
    from hdet_scale.train.refusals import attempts

    used, limit = attempts() or (0, 0)
    if used >= limit:
        return resume_advice(run)
    saved = last_checkpoint(run["run_dir"])
    where = (f"resumes from {saved[0]}" + (f" (step {saved[1]})" if saved[1] is not None else "")
             if saved else "starts again (no checkpoint was saved yet)")
    return f"It restarts the job (restart {used + 1} of {limit}), which {where} by itself."


def resume_advice(run: dict[str, Any]) -> str:
    """Where the last checkpoint of ``run`` is and how to continue from it (or that there
    is none and what to do instead): the second half of :func:`stop_message`, also said
    after a rank failed. Never raises."""
    run_dir = run["run_dir"]
    saved = last_checkpoint(run_dir)
    if saved is not None:
        folder, ck_step = saved
        of = f" (step {ck_step})" if ck_step is not None else ""
        if _an_earlier_runs(run):
            # a train.overwrite=true run stopped before its start replaced the earlier run
            # must not be told to resume that run's final checkpoint (which is refused)
            return (f"No checkpoint of this run was saved: {folder}{of} is the earlier run's in {run_dir}, which "
                    f"this run had not yet replaced (nothing of it was changed); start again with the same command.")
        if ck_step is not None and ck_step >= run["train"]["steps"]:
            # a stop between the final checkpoint and summary.json is not told to resume,
            # which is refused (nothing is left to do at train.steps)
            sched = ((run.get("deepspeed") or {}).get("hdet") or {}).get("schedule") or {}
            total = sched.get("total_steps") if isinstance(sched, dict) else None
            # "continue with a larger train.steps" is refused when the schedule ends at
            # train.steps (a resume keeps total_steps)
            on = (f"to train on, continue with a larger train.steps (up to deepspeed.hdet.schedule.total_steps="
                  f"{total}) and train.resume=true" if isinstance(total, int) and total > ck_step else
                  "the schedule ends there, so a resume has nothing left to train: the checkpoint holds the trained "
                  "model, without the final validation loss")
            return (f"Last checkpoint: {folder}{of}, the final one (train.steps={run['train']['steps']}): the "
                    f"training is done, but summary.json and the plots were not written (hdet-plot {run_dir} "
                    f"draws the plots); {on}.")
        return (f"Last checkpoint: {folder}{of}; continue with train.resume=true and the same run_dir "
                f"({run_dir}) and config.{_restart_note()}")
    every = run["train"].get("checkpoint_every") or 0
    why = f"train.checkpoint_every={every}" if every else "train.checkpoint_every=0 saves only at the end"
    # a stop before the first record leaves only the lock, and a plain rerun works
    held = [n for n in ("metrics.jsonl", "summary.json", "checkpoint") if os.path.lexists(os.path.join(run_dir, n))]
    again = (f"start again in {run_dir} with train.overwrite=true, or choose another run_dir" if held
             else f"start again with the same command (no checkpoint or metrics of this run were written in "
             f"{run_dir}{_wandb_left(run_dir)})")
    return f"No checkpoint was saved yet ({why}): {again}."


# When this process started: a checkpoint older than this is no save of this attempt's
# (the launcher, and every rank, import this module before anything is trained or removed).
_STARTED = time.time()


def _an_earlier_runs(run: dict[str, Any]) -> bool:
    """Whether ``run_dir/checkpoint/latest`` is another run's: this one neither resumes
    (``train.resume``) nor is a torchrun restart of the job that saved it, and ``latest``
    is older than this process (so this run saved nothing yet). Never raises."""
    if run["train"].get("resume"):
        return False
    from hdet_scale.train.rundir import restarted_job

    try:
        return (not restarted_job(run["run_dir"]) and os.stat(os.path.join(run["run_dir"], "checkpoint", "latest"))
                .st_mtime < _STARTED - _MTIME_SLACK_S)
    except OSError:
        return False


def _wandb_left(run_dir: str) -> str:
    """What W&B keeps in ``run_dir`` after a stop before the first record: its run folder
    (the newest of ``run_dir/wandb``, W&B's folder with the default ``wandb.dir``), which
    a rerun does not mind and which is the user's to keep (the stop line must not say
    "nothing of this run is kept" next to it). Never raises."""
    folder = os.path.join(run_dir, "wandb")
    try:
        runs = [e.path for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)
                and e.name.startswith(("offline-run-", "run-"))]
        newest = max(runs, key=os.path.getmtime, default=None)
    except OSError:
        return ""
    return f"; W&B's run folder {newest} stays" if newest else ""


def _restart_note() -> str:
    """Under ``torchrun --max-restarts N`` with restarts left, the agent ends the other
    workers with SIGTERM when one fails and then restarts the job, which resumes by
    itself: the advice above is then for a stop the user asked for. (The agent forwards
    a user's signal the same way; a worker cannot tell the two apart.)"""
    from hdet_scale.train.refusals import attempts

    used, limit = attempts() or (0, 0)
    if used >= limit:
        return ""
    return (f" If torchrun ended this attempt because a rank failed, it restarts the job (restart {used + 1} of "
            f"{limit}), which resumes from that checkpoint by itself.")


# What a signal does once this process's outcome is settled (settle): None while it trains.
_outcome: int | None = None


def settle(code: int) -> None:
    """This rank's outcome is decided (``0``: done, every file written; ``2``: its input was
    refused, the error printed): a later signal (the launcher ending the job) ends it with
    ``code`` and prints nothing, no stop line, no resume advice for a run that is complete
    or was refused."""
    global _outcome
    _outcome = code


def exit_completed() -> None:
    """End this rank of a completed run (every file written and closed, train's last
    barrier passed) with code 0: the atexit handlers run (W&B's teardown), the
    interpreter's own teardown does not. Its full garbage collection of torch's and
    DeepSpeed's module graphs keeps each rank alive 3-6 s after summary.json on a loaded
    2-core machine (measured); and under torchrun a C++ destructor in it can abort a rank
    after a restart ("terminate called without an active exception", SIGABRT), which
    torchrun reports as a failed run. Never returns."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_MTIME_SLACK_S = 2.0


def run_completed(run: dict[str, Any], since: float) -> bool:
    """Whether ``run_dir/summary.json`` is a complete JSON object written at or after
    ``since`` (``time.time()``; an earlier attempt's file does not count): the trainer
    writes it last, after the final checkpoint, so nothing is left to resume. Never raises."""
    path = os.path.join(run["run_dir"], "summary.json")
    try:
        # mtimes come from the kernel's coarse clock (a tick behind time.time(); whole
        # seconds on some filesystems): a file written just after `since` may read as
        # older (seen once in CI, a 143 for a completed run). An earlier attempt's file is
        # older by far more than the margin (a start-up lies between).
        if os.stat(path).st_mtime < since - _MTIME_SLACK_S:
            return False
        with open(path) as f:
            return isinstance(json_load(f), dict)
    except (OSError, ValueError):
        return False


def completed_message(what: int | str, run: dict[str, Any], since: float | None = None) -> str:
    """The line for a stop that came after the run completed (:func:`run_completed`):
    ``what`` is the signal, or what ended the ranks in words (``rank_failures.describe_failures``:
    a rank killed during the end-of-run plots is not reported as a failed run, exit 1,
    with advice to resume that would then be refused). ``since``: this attempt's
    start (``time.time()``), to tell whether the end-of-run plots were written (a stop
    during them leaves none: the line names ``hdet-plot``). Never raises."""
    what = f"{_NAMES.get(what, signal.Signals(what).name)} came" if isinstance(what, int) else what
    return (f"hdet-train: {what} after the run completed ({os.path.join(run['run_dir'], 'summary.json')} "
            f"written, final checkpoint saved): nothing is lost and nothing is left to resume"
            f"{_plots_left(run, since)}.")


def _plots_left(run: dict[str, Any], since: float | None) -> str:
    """``"; ... hdet-plot RUN_DIR ..."`` when the run was to write its plots
    (``train.plots``) and none in ``run_dir/plots`` is from this attempt; else ``""``."""
    if since is None or not run.get("train", {}).get("plots"):
        return ""
    from hdet_scale.plot_out import plotted_since

    # one PNG of several written does not count as "written"
    if plotted_since(os.path.join(run["run_dir"], "plots"), since):
        return ""
    return f"; its plots were not all written: hdet-plot {run['run_dir']} writes them"


def _gone(launcher: int, wait_s: float = 1.0) -> bool:
    """Whether the parent ``launcher`` died (this process was handed to another). The
    kernel sends the parent-death signal when the thread that started this process exits:
    in a parent being killed that can come while its other threads still live, and the
    parent's process id stays for a moment (seen under torchrun), so a signal from a live
    parent (a stop it forwards) costs ``wait_s`` more to tell apart."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == launcher:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def install_rank_handlers(run: dict[str, Any], announce: bool) -> None:
    """A rank started by ``torchrun`` or the ``deepspeed`` launcher: on SIGINT or SIGTERM
    end at once with :func:`exit_code` (``os._exit``: no ``KeyboardInterrupt`` traceback,
    no waiting on peers that are ending too; the metrics file is line-buffered, the
    checkpoint atomic), printing :func:`stop_message` first when ``announce`` (rank 0).
    Once :func:`settle` fixed the outcome it ends with that code, silently; once this
    attempt wrote ``summary.json`` (:func:`run_completed`) with 0, ``announce`` printing
    :func:`completed_message`. A rank that does not announce prints nothing.
    Python runs the handler between bytecodes of the main thread: a rank inside a
    collective whose peer already ended gets the peer's error first, then the handler."""

    from hdet_scale.train.rank_start import die_with_launcher
    from hdet_scale.train.startup import release_held_locks

    since = time.time()
    # a kill -9 of torchrun's agent would leave its ranks training, orphaned, holding
    # the run_dir; the kernel sends SIGTERM to this handler when it dies
    launcher = os.getppid()
    die_with_launcher(launcher)

    def handler(signum: int, frame: Any) -> None:
        release_held_locks()  # a DeepSpeed op lock this rank holds (start-up) must not outlive it
        if _outcome is not None:
            os._exit(_outcome)
        if run_completed(run, since):  # between summary.json and train's return: done
            if announce:
                from hdet_scale.train.refusals import failure_noted, note_completed

                # under torchrun, the failure its agent saw (a rank killed during the plots)
                # rather than its SIGTERM; the agent then says nothing more and exits 0
                what = failure_noted() or signum
                os.write(2, (completed_message(what, run, since) + "\n").encode())
                note_completed(run["run_dir"], said=True)
            os._exit(0)
        if announce:
            from hdet_scale.train.refusals import failure_noted

            failure = failure_noted()
            if _gone(launcher):  # the launcher died without ending the ranks
                at = attempt_step()
                line = (f"hdet-train: the launcher (process {launcher}) is gone without stopping the ranks (a kill -9, "
                        f"or the out-of-memory killer?): every rank stops, "
                        f"{f'at step {at}' if at is not None else 'before its first step'}. {resume_advice(run)}")
            elif failure:
                line = failed_message(failure, run, attempt_step())
            else:
                line = stop_message(signum, run, "every rank ends (its launcher forwards the signal to each)",
                                    attempt_step())
            os.write(2, (line + "\n").encode())
        os._exit(exit_code(signum))

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, handler)
