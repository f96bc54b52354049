"""torchrun, except that a stop signal (SIGINT, SIGTERM, SIGHUP: Ctrl-C, a scheduler's
SIGTERM, scancel, a closed terminal) ends it with exit code 128 + the signal's number and
no traceback (torchrun's console script prints its SignalException traceback after the
trainer's own stop line and exits 1). Run as ``python3 launchers/torchrun_quiet.py ARGS``
with torchrun's arguments; everything else is torchrun's (its agent still ends the ranks
on the signal; their output is untouched), but for the agent's warning lines about ending
them, which a stop silences.

A second difference: a refusal is not restarted. When the failed ranks exited 2 (hdet-train's
bad input: the config, a file, the environment) or 3 (a stale DeepSpeed op build lock,
which stays until removed), and the rest were ended by the agent, a restart meets the same
answer: the agent restarts nothing, its lines about the failure are not printed, and this
exits with that code after rank 0's one message, without torchrun's ``ChildFailedError``
summary and traceback (tester round 48: the message three times, then the traceback, exit
1). Any other failure (a crash: exit 1, a signal) is restarted as torchrun does, and
reported in one line naming the failed ranks and what comes next (a restart, or none left:
exit 1) in place of the agent's lines and of torchrun's summary and traceback; the ranks
the agent then ends find a note of it (``train/refusals.py``), so rank 0's line names the
failure and the checkpoint, not a SIGTERM (tester round 51). A failure after the run
completed (rank 0 wrote summary.json: a rank killed during the end-of-run plots) is no
failed run: one line says so, nothing is restarted, exit 0 (tester round 53: a restart then
refused "nothing is left to do", or exit 1); so is a stop signal then (exit 0, as
hdet-train's own launcher: rank 0's line says the run completed). This reads the exit codes of
``hdet_scale.train.cli`` ranks: run nothing else with it.

Used by torchrun_stop.sh (sourced by torchrun_single_node.sh and torchrun_multi_node.sh)
and slurm.sbatch.
"""
import logging
import os
import signal
import sys

del sys.path[0]  # as the torchrun command: nothing from the folder of this file


def stop(signum, frame):  # a signal before torchrun's own handlers are set
    sys.exit(128 + signum)


for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, stop)

# Started by torchrun_stop.sh (HDET_LAUNCHER_PID: the script) in a process group of its own:
# a kill -9 of the script forwards nothing, and torchrun and its ranks trained on, detached
# (tester round 52). The kernel sends SIGTERM when the script dies (Linux
# prctl(PR_SET_PDEATHSIG)), which ends the job as a stop does. Only for the script: run
# directly under nohup, this must outlive the shell that started it.
launcher = os.environ.pop("HDET_LAUNCHER_PID", "")
if launcher == str(os.getppid()):
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() != int(launcher):  # it died before the request took effect
        sys.exit(128 + signal.SIGTERM)
else:
    launcher = ""

import torch.distributed.elastic.multiprocessing.api as elastic_api  # noqa: E402
from torch.distributed.elastic.multiprocessing import SignalException  # noqa: E402


def agent_stop(signum, frame):  # torchrun's handler, whose agent then ends the ranks
    if launcher and os.getppid() != int(launcher):
        print(f"hdet-train: torchrun: its launcher script (process {launcher}) is gone without passing a signal on "
              "(a kill -9?): torchrun ends the ranks", file=sys.stderr, flush=True)
    # The agent's warnings about ending the ranks ("Received 15 death signal", "Sending
    # process N closing signal SIGTERM") repeat the trainer's stop line three times over:
    # silenced from the stop on; its errors still show. Its loggers carry their own level.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, agent_stop)
# torchrun sets its handler again when it starts the ranks: this one in its place
elastic_api._terminate_process_handler = agent_stop

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent  # noqa: E402
from torch.distributed.elastic.agent.server.api import WorkerState  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402

try:  # hdet-train's words for failed ranks; torchrun's own lines for a program without it
    from hdet_scale.train.rank_failures import describe_failures as describe
    from hdet_scale.train.refusals import clear_failure, completed_noted, note_failure
except ImportError:
    describe = None
failed: list[dict] = []  # {global rank: exit code} of a crash as first seen, until a restart runs
reported: list[bool] = []  # monitor() printed its line about it
global_rank: dict[int, int] = {}  # of each local rank, for the poll, which knows local ones

NOT_RESTARTED = (2, 3)  # as launchers/deepspeed_hostfile.sh: what a restart cannot fix
ENDED_BY_AGENT = (-signal.SIGTERM, -signal.SIGKILL)  # the agent ends a failed rank's siblings
refused: list[int] = []
completed: list[str] = []  # summary.json of a completed run that a rank failed after


def refusal(codes) -> int | None:
    """The code of a refusal when ``codes`` (the ranks' exit codes, None: running) are one
    refusal's and the agent's ends of the others; None otherwise."""
    own = {c for c in codes if c in NOT_RESTARTED}
    if len(own) == 1 and all(c in (None, 0, *NOT_RESTARTED, *ENDED_BY_AGENT) for c in codes):
        return own.pop()
    return None


def quiet_poll(self):  # the agent's poll of its ranks, silent when it finds a failure
    codes = {local: h.proc.poll() for local, h in self.subprocess_handlers.items()}
    if not any(codes.values()) or describe is None and refusal(codes.values()) is None:
        return poll(self)
    if describe is not None and not failed and refusal(codes.values()) is None:
        # a crash, seen before poll() ends the other ranks: a note for them, whose stop
        # line would otherwise blame a SIGTERM (tester round 51)
        failed.append({global_rank.get(local, local): c for local, c in codes.items() if c})
        note_failure(os.getpid(), describe(failed[0], hint=False).removeprefix("failed: "))
    # "Sending process N closing signal SIGTERM" and "failed (exitcode: 2)" would follow
    # rank 0's message on a refusal, and on a crash repeat the line monitor() prints
    quiet = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
             if n.startswith("torch.distributed.elastic")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    try:
        return poll(self)
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)


def monitor(self, worker_group):  # the agent's monitor: a refusal leaves no restart
    global_rank.update({w.local_rank: w.global_rank for w in worker_group.workers})
    result = monitor_workers(self, worker_group)
    if not result.is_failed():
        if failed and result.state == WorkerState.HEALTHY:  # restarted: the ranks run again
            failed.clear()
            reported.clear()
            clear_failure(os.getpid())
        return result
    codes = {rank: f.exitcode for rank, f in result.failures.items()}
    if (code := refusal(codes.values())) is not None:
        self._remaining_restarts = 0
        refused.append(code)
    elif failed and not reported and (done := completed_noted(os.getpid())) is not None:
        # after rank 0 wrote summary.json (tester round 53: a rank's SIGABRT in its exit after
        # a restart, reported as a failed run, exit 1): nothing to restart, exit 0
        reported.append(True)
        self._remaining_restarts = 0
        completed.append(done[0])
        if not done[1]:  # rank 0 had ended and said nothing of it
            print(f"hdet-train: torchrun: {describe(failed[0], hint=False).removeprefix('failed: ')} after the run "
                  f"completed ({done[0]} written, final checkpoint saved): nothing is lost and nothing is left to "
                  "resume.", file=sys.stderr, flush=True)
    elif failed and not reported:
        # a crash: one line saying which ranks failed first and what comes next (tester
        # round 51: no line named the checkpoint, then ChildFailedError's traceback)
        reported.append(True)
        left, limit = self._remaining_restarts, worker_group.spec.max_restarts
        then = (f"torchrun ends the other ranks and restarts the job (restart {limit - left + 1} of {limit}), "
                "which resumes from its last checkpoint" if left > 0 else
                f"no restarts left (--max-restarts={limit}): torchrun ends the other ranks and exits 1")
        print(f"hdet-train: torchrun: {describe(failed[0])}; {then}.", file=sys.stderr, flush=True)
    return result


poll, elastic_api.SubprocessContext._poll = elastic_api.SubprocessContext._poll, quiet_poll
monitor_workers, LocalElasticAgent._monitor_workers = LocalElasticAgent._monitor_workers, monitor

from torch.distributed.run import main  # noqa: E402

sys.argv[0] = "torchrun"
try:
    sys.exit(main())
except SignalException as e:
    # a stop during the end-of-run plots: rank 0 said the run completed (its note); the
    # agent ended the ranks before this, so the note is there if rank 0 wrote it
    if describe is not None and completed_noted(os.getpid()) is not None:
        sys.exit(0)
    sys.exit(128 + int(e.sigval))
except ChildFailedError as e:
    if completed:  # a rank failed after the run completed: said by monitor() or rank 0
        sys.exit(0)
    if not refused:
        # a failure with no restarts left: monitor() named the ranks and rank 0 the checkpoint;
        # no traceback of the agent's own (tester round 51)
        if not failed:
            print(str(e).strip("\n"), file=sys.stderr, flush=True)
        sys.exit(1)
    sys.exit(refused[-1])  # rank 0 printed the one message
finally:
    try:  # the refusal the ranks left for restarts that did not come (train/refusals.py)
        from hdet_scale.train.refusals import forget_agent
    except ImportError:  # torchrun for a program without hdet_scale installed
        pass
    else:
        forget_agent(os.getpid())
