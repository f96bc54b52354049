"""A refusal remembered across ``torchrun``'s restarts of one job.

``torchrun --max-restarts N`` restarts every rank when one exits non-zero, whatever the
exit code. A bad input found by the ranks' own checks (a ``modules`` pattern matching
nothing, ``axes.lr.groups: [3]``) is refused again by every attempt, each paying the
import of torch, DeepSpeed and transformers: 53 s for 4 DeepSpeed ranks with 3 restarts.
The first attempt's ranks leave the message in a marker; a restarted
attempt reads it before importing anything and exits at once with the same message.

The marker is keyed by the elastic agent's process id (the ranks' parent, the same for
every restart of one ``torchrun`` and different for the next ``torchrun``), the command
line and the working directory, so a new ``torchrun`` (a fixed config) checks afresh.
It holds only refusals of the checks that read config and files before anything starts
(deterministic: each restart would find the same); failures during training (a crash, a
rank that cannot load its own file) are left to the restart, as ``torchrun`` means.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

#: torchrun's restart count of this attempt (0: the first); absent outside torchrun.
RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"


def attempts() -> tuple[int, int] | None:
    """``(this attempt's restart count, --max-restarts)`` under ``torchrun``
    (``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``); ``None`` outside it or
    when either is not an integer. The one reader of the two (they were read in four
    places). Never raises."""
    try:
        return int(os.environ[RESTART_VAR]), int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
    except (KeyError, ValueError):
        return None


def _folder() -> str:
    return os.path.join(tempfile.gettempdir(), f"hdet-train-refusals-{os.getuid()}")


def _marker(argv: list[str]) -> str | None:
    """The marker's path for this job and command, or ``None`` outside torchrun."""
    if RESTART_VAR not in os.environ:
        return None
    key = "\0".join([os.environ.get("TORCHELASTIC_RUN_ID", ""), os.getcwd(), *argv])
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return os.path.join(_folder(), f"{os.getppid()}-{digest}")


def _last_attempt() -> bool:
    now = attempts()
    return now is not None and now[0] >= now[1]


def _attempt() -> int:
    try:
        return int(os.environ.get(RESTART_VAR, "0"))
    except ValueError:
        return 0


def remembered(argv: list[str]) -> str | None:
    """The message an earlier attempt of this ``torchrun`` job refused ``argv`` with, on a
    restarted attempt (``TORCHELASTIC_RESTART_COUNT`` > 0); ``None`` on the first attempt,
    outside torchrun, or when no attempt refused. Never raises."""
    path = _marker(argv)
    if path is None or _attempt() < 1:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def remember(argv: list[str], message: str) -> None:
    """Leave ``message`` (a refusal of the pre-start checks) for this job's restarts. Each
    rank writes it (whole, by rename: a reader sees one rank's complete text or none);
    a failure to write only costs the restarts their time. Never raises."""
    path = _marker(argv)
    if path is None or _last_attempt():  # no restart follows to read it (--max-restarts=0)
        return
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(message)
        os.replace(tmp, path)
    except OSError:
        pass


def forget_on_last_attempt(argv: list[str]) -> None:
    """Remove the marker on torchrun's last attempt (``TORCHELASTIC_MAX_RESTARTS``), so
    the temporary folder does not keep it. Called by rank 0 after it read the marker; a
    rank that reads later finds none and runs the checks itself (the agent ends it when
    rank 0 exits). Never raises."""
    path = _marker(argv)
    if path is not None and _last_attempt():
        try:
            os.remove(path)
        except OSError:
            pass


def forget_agent(agent_pid: int) -> None:
    """Remove every marker left for the agent ``agent_pid`` (the ranks' parent): called by
    ``launchers/torchrun_quiet.py`` as it ends, since it restarts no refusal and no last
    attempt then removes the marker. Never raises."""
    try:
        names = os.listdir(_folder())
    except OSError:
        return
    for name in names:
        if name.startswith(f"{agent_pid}-"):
            try:
                os.remove(os.path.join(_folder(), name))
            except OSError:
                pass


# What the agent saw fail, for the ranks it then ends (launchers/torchrun_quiet.py): a rank
# cannot tell the agent's SIGTERM after a failure from a user's signal it forwards (rank 0
# would say "stopped by SIGTERM" after another rank was killed).
def _failure_file(agent_pid: int) -> str:
    return os.path.join(_folder(), f"{agent_pid}-failed")


def note_failure(agent_pid: int, text: str) -> None:
    """The agent ``agent_pid`` found its ranks failed (``text``: which, in words) and is about
    to end the others: leave it for their signal handlers (:func:`failure_noted`). Written
    whole, by rename. Never raises."""
    _write(_failure_file(agent_pid), text)


def _write(path: str, text: str) -> None:
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        pass


def clear_failure(agent_pid: int) -> None:
    """The agent's ranks run again (a restart): no failure is theirs. Never raises."""
    try:
        os.remove(_failure_file(agent_pid))
    except OSError:
        pass


def failure_noted() -> str | None:
    """In a rank under ``torchrun`` (through launchers/torchrun_quiet.py): the failure its
    agent (the parent) noted before ending this rank, in words; ``None`` otherwise (a
    user's signal, another launcher). Never raises."""
    if RESTART_VAR not in os.environ:
        return None
    try:
        with open(_failure_file(os.getppid()), encoding="utf-8") as f:
            return f.read() or None
    except (OSError, UnicodeDecodeError):
        return None


# Rank 0's word to the agent that the run completed (a rank that dies after summary.json
# would otherwise be reported as a failed run, exit 1): the agent then restarts nothing and
# exits 0 (launchers/torchrun_quiet.py), as hdet-train's own launcher does.
def _completed_file(agent_pid: int) -> str:
    return os.path.join(_folder(), f"{agent_pid}-completed")


def note_completed(run_dir: str, said: bool) -> None:
    """In rank 0 under ``torchrun``: this attempt wrote ``run_dir/summary.json`` (the run is
    complete), for its agent (:func:`completed_noted`); ``said``: rank 0 printed the line
    about a stop or failure after it (``stopping.completed_message``), so the agent prints
    none. Nothing outside torchrun. Never raises."""
    if RESTART_VAR in os.environ:
        _write(_completed_file(os.getppid()), f"{'said' if said else 'quiet'}\n{os.path.join(run_dir, 'summary.json')}")


def completed_noted(agent_pid: int) -> tuple[str, bool] | None:
    """``(summary.json's path, whether rank 0 said so)`` when a rank 0 of the agent
    ``agent_pid`` noted a completed run (:func:`note_completed`); ``None`` otherwise.
    Never raises."""
    try:
        with open(_completed_file(agent_pid), encoding="utf-8") as f:
            said, _, path = f.read().partition("\n")
    except (OSError, UnicodeDecodeError):
        return None
    return (path, said == "said") if path else None


#: How long a rank other than 0 waits after refusing, for rank 0 to print the message.
QUIET_RANK_WAIT_S = 10.0


def wait_for_rank0() -> None:
    """Called by a rank other than 0 that refuses an input and prints nothing: wait up to
    ``QUIET_RANK_WAIT_S`` seconds before exiting. The launcher (torchrun's agent, the
    DeepSpeed launcher) ends every rank once one exits non-zero; a quiet rank that exits
    first can get rank 0 killed before it prints the one line the user needs (CI, stop
    24: the last restart's message lost). Rank 0 meets the same refusal (the checks are
    the same everywhere) and exits within a second, so the agent ends this wait early;
    the bound keeps a launcher that does not end siblings from waiting long."""
    import time

    time.sleep(QUIET_RANK_WAIT_S)
