"""``hdet-train``'s own launcher: started bare (not under ``torchrun``), it starts
``nproc`` local ranks itself (CPU, gloo), waits for them, and stops them all when one
fails or a signal arrives (docs/failure_semantics.md, "A dead rank", "A signal").
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from typing import Any

from hdet_scale.backends.op_builds import build_interrupted, op_missing
from hdet_scale.errors import HDETConfigError, HDETStateError
from hdet_scale.train.rank_start import die_with_launcher, rank_context, rank_start_method
from hdet_scale.train.rank_failures import BUILD_STOPPED, OP_MISSING, PEER_LOST, describe_failures, peer_lost

USER_ERROR = 2  # the exit code of HDETConfigError / HDETStateError
_REPORT_WAIT_S = 60  # a rank with bad input waits this long for the launcher to end it
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what the launcher acts on
REPEAT_S = 1.0  # a signal this soon after the first is the same stop, sent twice (to the process and its group)


def _stop_arrives(received: list[int], wait_s: float = 1.0) -> bool:
    """Whether a stop signal is (or within ``wait_s`` becomes) among ``received``."""
    deadline = time.monotonic() + wait_s
    while not received and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(received)


class _RankMessages:
    """The ranks' refusals (``str``) for the launcher: one pipe per rank, written by that
    rank alone. Not a ``SimpleQueue``: its two locks are semaphores, which
    multiprocessing's resource tracker reports as "leaked" (a raw ``UserWarning``) when
    the launcher is killed. The launcher keeps every writing end open,
    so a reader never meets an end-of-file."""

    def __init__(self, ctx: Any, n: int) -> None:
        self._pipes = [ctx.Pipe(duplex=False) for _ in range(n)]

    def writer(self, rank: int) -> Any:
        return self._pipes[rank][1]

    def empty(self) -> bool:
        return not any(reader.poll() for reader, _ in self._pipes)

    def get_all(self) -> list[str]:
        out = []
        for reader, _ in self._pipes:
            while reader.poll():
                try:
                    out.append(reader.recv())
                except (EOFError, OSError):
                    break
        return out


def _rank_main(run: dict, rank: int, world: int, port: int, errors, launcher: int, progress) -> None:
    parent = os.getppid()  # the fork server (launch_local), or the launcher itself
    die_with_launcher(launcher, None if parent == launcher else parent)
    if rank == 0:
        from hdet_scale.train.stopping import share_progress

        share_progress(progress)  # the step the stop line names
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    from hdet_scale.train.loop import train

    try:
        summary = train(run)
    except (HDETConfigError, HDETStateError) as e:
        # The launcher prints each distinct message once and ends every rank. Until then this
        # rank stays, its connections open: its peers, maybe inside a collective with it,
        # end by SIGTERM instead of each printing a "connection closed" traceback.
        errors.send(str(e))
        time.sleep(_REPORT_WAIT_S)
        sys.exit(USER_ERROR)
    except (ImportError, OSError) as e:
        if op_missing(e) is None:
            raise
        # the op build this rank waited on (another rank's) ended without the op, stopped
        # by the Ctrl-C that reached its ninja, or it failed; the builder's error, or the
        # launcher's stop line, says why: this rank's ImportError traceback would only
        # repeat it. The launcher names this exit (describe_failures).
        sys.exit(OP_MISSING)
    except RuntimeError as e:
        if build_interrupted(e):
            # a Ctrl-C reaches the op build (ninja, in this rank's process
            # group) while the rank ignores it: the launcher got it too and prints the stop line
            sys.exit(BUILD_STOPPED)
        if not peer_lost(e):
            raise
        # one rank killed, and each of the others would print gloo's "Connection reset by
        # peer" traceback. The launcher names the rank that ended first and the last
        # checkpoint; this rank's part is only that it lost that peer.
        sys.exit(PEER_LOST)
    if rank == 0:
        print(json.dumps(summary, indent=2), flush=True)
    from hdet_scale.train.stopping import exit_completed

    exit_completed()  # no interpreter teardown: nothing is left to save


class StopSignals:
    """The stop signals (SIGINT, SIGTERM, SIGHUP) the local launcher received, in order.

    A second signal means "stop waiting, kill the ranks" only when it comes
    :data:`REPEAT_S` seconds or more after the first: GNU ``timeout`` and batch
    schedulers signal the launcher and then its whole process group at once (that copy
    would SIGKILL a rank building a DeepSpeed op, and the op's lock it held would then
    refuse every later start). ``clock``: seconds, monotonic."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.received: list[int] = []
        self._clock = clock
        self._first: float | None = None

    def add(self, signum: int) -> bool:
        """Record ``signum``; ``True`` when the ranks are to be killed at once."""
        now = self._clock()
        if self._first is None:
            self._first = now
        self.received.append(signum)
        return len(self.received) > 1 and now - self._first >= REPEAT_S


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end(procs: list, grace: float) -> None:
    """SIGTERM to every rank still running, SIGKILL to any left after ``grace`` s."""
    procs = [p for p in procs if p.pid is not None]  # started (a signal may stop the starting)
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


class StoppedBeforeStart(BaseException):
    """A stop signal before any rank started (:func:`raise_stop`); a BaseException, so that
    no ``except Exception`` on the way (DeepSpeed's cpuinfo query swallows those) keeps it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    def line(self) -> str:
        """The one line hdet-train prints for it."""
        name = signal.Signals(self.signum).name
        return f"hdet-train: stopped by {name}{' (Ctrl-C)' if name == 'SIGINT' else ''} before any rank started"


def raise_stop(signum: int, frame: Any) -> None:
    """A signal handler for the moments before any rank starts: raise :class:`StoppedBeforeStart`."""
    raise StoppedBeforeStart(signum)


def start_lines(run: dict) -> list[str]:
    """What ``launch_local`` says before it starts the ranks: that they start, and the
    launcher variables it does not read (else up to 49 s of silence while the ranks
    build their engines, and ``MASTER_PORT=abc`` accepted without a word)."""
    n, hdet = run["nproc"], run["deepspeed"].get("hdet") or {}
    replicas = hdet.get("replicas", 1)
    lines = []
    ignored = [f"{k}={os.environ[k]}" for k in ("MASTER_ADDR", "MASTER_PORT") if k in os.environ]
    if ignored:
        lines.append(f"hdet-train: note: {' '.join(ignored)} in the environment is not used: hdet-train starts its "
                     f"{n} ranks itself, at 127.0.0.1 on a free port; MASTER_ADDR/MASTER_PORT are read under torchrun "
                     "or the deepspeed launcher (with RANK and WORLD_SIZE)")
    # not "2 replica groups of 1 rank": "replica group" would name one model copy, where
    # the dry run and the docs mean the ranks holding one shard index in every replica
    lines.append(f"hdet-train: starting {n} ranks on this machine ({run['backend']}: {replicas} replica"
                 f"{'s' if replicas != 1 else ''} of the model, {n // replicas} rank{'s' if n // replicas != 1 else ''} "
                 "each); the "
                 "first step follows once every rank has built its model and engine")
    return lines


# What torchrun, the deepspeed launcher, srun and mpirun set beside RANK (any one of them)
_LAUNCHER_MARKS = ("TORCHELASTIC_RUN_ID", "LOCAL_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def under_launcher() -> bool:
    """Whether a known launcher (torchrun, the deepspeed launcher, srun, mpirun) started
    this process: one of its own variables (``_LAUNCHER_MARKS``) is set beside ``RANK``."""
    return any(k in os.environ for k in _LAUNCHER_MARKS)


def unlaunched_world_note() -> str | None:
    """A note for any rank when ``RANK``/``WORLD_SIZE``/``MASTER_*`` are set but no known
    launcher started this process (left in a shell, they make hdet-train rank 0 of a
    world whose other ranks never come, ``nproc`` unused, and nothing would say so for
    60 s; the same with a leftover RANK=1, where only rank 0 would speak). ``None`` under
    a launcher, or when the world is this process alone."""
    env = os.environ
    if under_launcher() or env.get("WORLD_SIZE", "1").strip() == "1":
        return None
    given = " ".join(f"{k}={env[k]}" for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k in env)
    return (f"{given} are set in the environment and no launcher (torchrun, deepspeed, srun, mpirun) started this "
            f"process: it joins that world as rank {env.get('RANK', '?').strip()} and waits for the other ranks "
            "(nproc is not used); to let hdet-train start its own ranks, unset them (env -u RANK -u WORLD_SIZE "
            "-u MASTER_ADDR -u MASTER_PORT hdet-train ...)")


def shared_store_restarts() -> str | None:
    """Why this torchrun job would hang at its first restart, or ``None``: torchrun
    ``--max-restarts`` >= 1 (``TORCHELASTIC_MAX_RESTARTS``) with its rendezvous store shared
    with the ranks (``TORCHELASTIC_USE_AGENT_STORE=True``, unless
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``). The restarted gloo world then reads the dead
    attempt's addresses (pytorch issue 135712): restart 1 fails with "connectFullMesh
    failed" and restart 2 waits until killed. Read from the environment
    only, the same on every rank, before any collective."""
    try:
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    except ValueError:
        return None
    if restarts < 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return (f"environment: torchrun --max-restarts={restarts} shares its rendezvous store with the ranks, and a "
            "restarted attempt then reads the dead attempt's addresses and cannot connect (it fails or hangs; "
            "pytorch issue 135712): set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 where torchrun starts (the scripts "
            "in launchers/ do), or run with --max-restarts=0")


def launch_local(run: dict) -> int:
    """Start ``run["nproc"]`` local ranks (spawned, gloo), wait for them and return the
    exit code ``hdet-train`` ends with (module docstring of ``hdet_scale.train.cli``):
    the first rank's bad input ends all ranks (2, each distinct message printed once), a
    crash ends the others after 10 s (1, the failed ranks and how they ended named), a
    signal ends every rank and names the last checkpoint (128 + signal; 0 if the run had
    completed)."""
    from hdet_scale.train.startup import STALE_LOCK_EXIT
    from hdet_scale.train.stopping import (
        GRACE_S,
        completed_message,
        exit_code,
        resume_advice,
        run_completed,
        stop_message,
    )

    started = time.time()  # a summary.json from before this launch is an earlier attempt's
    try:
        method = rank_start_method()  # read by this launcher alone (torchrun starts its own ranks)
    except HDETConfigError as e:
        print(f"hdet-train: error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR
    n = run["nproc"]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    if run["backend"] == "deepspeed":  # asked once here, not twice in every rank (backends/ds_cpuinfo.py)
        from hdet_scale.backends.ds_cpuinfo import share

        # Ctrl-C in the cpuinfo subprocess's wait (a second or two) would be a
        # KeyboardInterrupt traceback, a SIGTERM an exit without a word
        saved = {sig: signal.signal(sig, raise_stop) for sig in STOP_SIGNALS
                 if signal.getsignal(sig) is not signal.SIG_IGN}
        try:
            os.environ.update(share())
        except StoppedBeforeStart as e:
            print(e.line(), file=sys.stderr, flush=True)
            return 128 + e.signum
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
    for line in start_lines(run):
        print(line, file=sys.stderr, flush=True)
    ctx = rank_context(method, run["backend"])
    forked = method == "forkserver"
    # multiprocessing's resource tracker ignores SIGINT and SIGTERM but dies of SIGHUP, which
    # a closing terminal sends to the whole process group: "process died unexpectedly" and
    # KeyError tracebacks after a clean stop. Started here with SIGHUP
    # ignored (kept through its exec), before the queue's lock would start it.
    from multiprocessing import resource_tracker

    hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGHUP, hup)
    errors = _RankMessages(ctx, n)
    port = _free_port()
    progress = ctx.Value("q", -1, lock=False)  # rank 0's last optimizer step (stopping.note_step)
    procs = [ctx.Process(target=_rank_main, args=(run, r, n, port, errors.writer(r), os.getpid(), progress))
             for r in range(n)]
    stops = StopSignals()
    received = stops.received

    def on_signal(signum, frame):
        if stops.add(signum):  # a person's second Ctrl-C: no more waiting
            for p in procs:
                if p.is_alive():
                    p.kill()

    # The ranks start with SIGINT and SIGHUP ignored (kept through exec; Python then
    # installs no KeyboardInterrupt handler): the terminal sends a Ctrl-C, or SIGHUP when it
    # closes, to every process of the job, and only this launcher acts on it, ending the
    # ranks with SIGTERM (stopping.py). Between two starts the launcher listens, so a
    # signal while many ranks start stops the starting.
    # A stop signal ignored when hdet-train started stays ignored, as Python and bash leave
    # it: `nohup hdet-train &` goes on when the terminal closes (SIGHUP), a script's
    # background job is not stopped by the terminal's Ctrl-C (SIGINT). Taking both over
    # would let the terminal's close stop a nohup run.
    taken = {sig for sig in STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}
    if signal.SIGTERM in taken:
        signal.signal(signal.SIGTERM, on_signal)
    try:
        if forked:
            # The fork server starts with SIGINT and SIGHUP ignored, as a spawned rank
            # would, and its ranks keep that (forked, not started from here). It then
            # imports for seconds before the first rank exists; the launcher listens
            # meanwhile, so a stop in that wait stops the starting.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            from multiprocessing import forkserver

            forkserver.ensure_running()
            for sig in taken - {signal.SIGTERM}:
                signal.signal(sig, on_signal)
        for p in procs:
            if received:
                break
            if not forked:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
            try:
                p.start()
            except (EOFError, OSError):
                # the server ended by the group's SIGTERM while it imported: this
                # launcher's copy of the signal says so within moments
                if not _stop_arrives(received):
                    raise
                break
            if not forked:
                for sig in taken - {signal.SIGTERM}:
                    signal.signal(sig, on_signal)
        while any(p.is_alive() for p in procs) and not received:
            if not errors.empty():  # a rank's bad input (_rank_main): end all ranks now
                break
            if any(p.exitcode not in (None, 0) for p in procs):
                # give the other ranks a moment to fail by themselves, then stop them
                deadline = time.monotonic() + 10
                while any(p.is_alive() for p in procs) and time.monotonic() < deadline and not received:
                    time.sleep(0.2)
                break
            time.sleep(0.2)
        if received:
            _end(procs, GRACE_S)
            if run_completed(run, started):  # the ranks were past the last file: nothing to resume
                print(completed_message(received[0], run, started), file=sys.stderr, flush=True)
                return 0
            step = progress.value if progress.value >= 0 else None
            print(stop_message(received[0], run, f"all {n} ranks ended", step), file=sys.stderr, flush=True)
            return exit_code(received[0])
        failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
        if not failed and errors.empty():
            return 0
        _end(procs, 10)
        messages = []
        for msg in errors.get_all():
            if msg not in messages:
                messages.append(msg)
        for msg in messages:
            print(f"hdet-train: error: {msg}", file=sys.stderr)
        if messages:  # a rank's bad input came first; the other ranks ended because it did
            return USER_ERROR
        if run_completed(run, started):  # a rank lost during the plots or the last barrier
            line = describe_failures(failed, hint=False).removeprefix("failed: ")
            print(completed_message(line, run, started), file=sys.stderr, flush=True)
            return 0
        codes = set(failed.values())
        if codes == {STALE_LOCK_EXIT}:
            return STALE_LOCK_EXIT  # local rank 0 named the lock
        print(f"hdet-train: {describe_failures(failed)}. {resume_advice(run)}", file=sys.stderr)
        return 1
    finally:
        for s in STOP_SIGNALS:
            # The exit code is decided (this is hdet-train's last act): a signal arriving
            # now, a repeat after a stop (the group's copy of timeout's SIGTERM, a late
            # second Ctrl-C) or a first one after the ranks ended, must not turn it into a
            # KeyboardInterrupt traceback or, once Python's teardown put SIGINT back to its
            # default, a silent death by the signal (exit 130, no line, for a completed
            # run).
            signal.signal(s, signal.SIG_IGN)
