"""The stale-lock rule of ``hdet_scale/train/startup.py`` on real lock files: torch's own
``FileBaton`` holding one (a live build), and files left behind by nobody.

The end-to-end checks, a run that names a planted stale lock instead of hanging:
tests/distributed/test_bad_inputs.py (``stale_op_lock``: the launcher, before any rank
starts) and tests/distributed/test_startup.py (every rank, under torchrun).
"""

from __future__ import annotations

import os
import signal
import time

from torch.utils.file_baton import FileBaton

from hdet_scale.train import startup


def backdate(path, seconds: float) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


def test_a_lock_a_live_process_holds_is_never_stale_however_old(tmp_path):
    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    baton = FileBaton(str(lock))
    assert baton.try_acquire()  # what torch's loader does while it builds and imports an op
    try:
        backdate(lock, 3600)
        assert startup.lock_holders(str(lock)) == [os.getpid()]
        assert not startup.is_stale(str(lock))
        assert startup.stale_trainer_locks(str(tmp_path)) == []
    finally:
        baton.release()
    assert not lock.exists()


def test_a_lock_nobody_holds_is_stale_only_once_old_enough(tmp_path):
    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    lock.write_text("")  # left behind: created, its process gone
    assert startup.lock_holders(str(lock)) == []
    assert not startup.is_stale(str(lock))  # young: a holder may be between its close and its remove
    backdate(lock, startup.STALE_AFTER_S + 1)
    assert startup.is_stale(str(lock))
    assert startup.stale_trainer_locks(str(tmp_path)) == [str(lock)]
    message = startup.stale_lock_message(str(lock))
    assert f"rm {lock}" in message and "prebuilt" in message


def test_a_prebuilt_op_is_never_blocked_by_its_folders_lock(tmp_path, monkeypatch):
    """An op DeepSpeed was installed with is imported, not JIT-loaded (``OpBuilder.load``
    reads ``installed_ops``): the launcher refused such a start for a stale lock (exit 3)
    that the README says it never needs. DeepSpeed's own table stands in for a prebuilt
    install (building one takes 150 s more than the suite's install)."""
    from deepspeed import git_version_info

    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    backdate(lock, startup.STALE_AFTER_S + 1)
    assert startup.stale_trainer_locks(str(tmp_path)) == [str(lock)]  # JIT-loaded here: it blocks
    monkeypatch.setitem(git_version_info.installed_ops, "fused_adam", True)
    assert "fused_adam" in startup.prebuilt_ops()
    assert startup.stale_trainer_locks(str(tmp_path)) == []
    assert lock.exists()  # named, never removed


def test_extensions_dir_is_torch_extensions_dir_itself(tmp_path, monkeypatch):
    """TORCH_EXTENSIONS_DIR holds the op folders directly; the default adds a
    py<version>_<accelerator> level."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert startup.extensions_dir() == str(tmp_path)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert os.path.basename(startup.extensions_dir()).startswith("py3")


def _advice(message: str) -> str:
    """The command in the message's "Delete it (<command>)"."""
    return message.split("Delete it (", 1)[1].split(")", 1)[0]


def test_the_advice_clears_whatever_blocks_the_loader(tmp_path):
    """Anything at the lock's name blocks torch's loader (its O_CREAT | O_EXCL open fails):
    an empty or non-empty folder, a dangling symbolic link, a file. For each, the message
    names what is there and its command, run in a shell, clears it, after which torch's
    own FileBaton acquires the lock: a folder gets no ``rm <lock>`` (rm refuses a folder),
    and a dangling link is called stale (its age is not taken by stat through the link)."""
    import subprocess

    def folder(lock):
        lock.mkdir()

    def full_folder(lock):
        lock.mkdir()
        (lock / "junk").write_text("x")

    def dangling(lock):
        lock.symlink_to(tmp_path / "nowhere")

    def plain(lock):
        lock.write_text("")

    for make, kind, command in ((folder, "a folder", "rmdir"), (full_folder, "a folder", "rm -r"),
                                (dangling, "a symbolic link", "rm"), (plain, None, "rm")):
        lock = tmp_path / make.__name__ / "fused_adam" / "lock"
        lock.parent.mkdir(parents=True)
        make(lock)
        assert not FileBaton(str(lock)).try_acquire()  # the loader would wait on it forever
        os.utime(lock, (time.time() - 3600,) * 2, follow_symlinks=False)
        assert startup.stale_trainer_locks(str(lock.parent.parent)) == [str(lock)], make.__name__
        message = startup.stale_lock_message(str(lock))
        assert (kind is None and "a folder" not in message and "link" not in message) or kind in message, message
        advice = _advice(message)
        assert advice == f"{command} {lock}", (make.__name__, advice)
        subprocess.run(advice, shell=True, check=True)
        assert not os.path.lexists(lock)
        baton = FileBaton(str(lock))
        assert baton.try_acquire()
        baton.release()


# ---- a signal while this process holds a lock ---------------------------------------------
# A rank stopped while torch's loader holds <op>/lock must not leave it behind: every later
# start would wait on it. These run a real child process doing what the loader does (torch's own
# FileBaton inside startup.watch_op_locks, a build child like ninja), signal it, and look at
# the files and processes.

HOLDER = r"""
import os, signal, subprocess, sys, time
from torch.utils.file_baton import FileBaton
from hdet_scale.train import startup, stopping
mode, lock, theirs = sys.argv[1:4]
if mode == "torchrun":  # the rank-side handlers a torchrun rank installs (cli.main)
    stopping.install_rank_handlers({"run_dir": os.path.dirname(lock), "train": {"checkpoint_every": 0}}, True)
else:  # a local launcher's rank: SIGINT ignored, SIGTERM left at its default
    signal.signal(signal.SIGINT, signal.SIG_IGN)
with startup.watch_op_locks(announce=False):
    assert not FileBaton(theirs).try_acquire()  # another process's lock: never recorded
    baton = FileBaton(lock)
    assert baton.try_acquire()
    build = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # "ninja", started while held
    print(build.pid, flush=True)
    time.sleep(120)
"""


def _holder(tmp_path, mode: str):
    import subprocess
    import sys

    lock, theirs = tmp_path / "op" / "lock", tmp_path / "other" / "lock"
    lock.parent.mkdir()
    theirs.parent.mkdir()
    theirs.write_text("")
    child = subprocess.Popen([sys.executable, "-c", HOLDER, mode, str(lock), str(theirs)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    build = int(child.stdout.readline() or 0)
    assert build and lock.exists(), child.communicate()
    return child, build, lock, theirs


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True  # ended; its parent (gone too) just did not reap it yet
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_sigterm_while_holding_an_op_lock_removes_it_and_stops_the_build(tmp_path):
    """A local launcher's rank (SIGTERM at its default) holding the lock: it still dies by
    SIGTERM (exit -15, as before), but its lock is gone, its build child stopped, and the
    lock of another process it looked at stays."""
    child, build, lock, theirs = _holder(tmp_path, "local")
    child.send_signal(signal.SIGINT)  # ignored in such a rank: nothing happens
    time.sleep(0.5)
    assert child.poll() is None and lock.exists()
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGTERM, err
    assert not lock.exists() and theirs.exists(), err
    assert _gone(build), "the build process outlived the stopped rank"


def test_sigint_under_torchrun_removes_the_lock_and_says_before_the_first_step(tmp_path):
    """A torchrun rank (stopping.install_rank_handlers): its exit code and line as without a
    lock, the lock removed first. The line says the attempt trained no step (there is none
    here to name; not the step of metrics.jsonl, which an earlier attempt of a resumed run
    may have written)."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 8}\n')  # an earlier attempt's record
    child, build, lock, theirs = _holder(tmp_path, "torchrun")
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=30)
    assert child.returncode == 130, err
    assert not lock.exists() and theirs.exists(), err
    assert _gone(build)
    assert "stopped by SIGINT (Ctrl-C) before its first step" in err and "step 8" not in err, err


def test_recorded_locks_only_while_held_and_never_a_replaced_file(tmp_path, monkeypatch):
    """Acquire and release inside watch_op_locks: recorded, then not, and the signal
    handlers are back as they were. A lock file replaced at the same path (removed by hand,
    then created by another process) is not the one this process made: never removed."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    lock = tmp_path / "op" / "lock"
    lock.parent.mkdir()
    with startup.watch_op_locks(announce=False):
        baton = FileBaton(str(lock))
        assert baton.try_acquire()
        assert startup.held_locks() == [str(lock)]
        assert signal.getsignal(signal.SIGTERM) is startup._on_stop
        baton.release()
        assert startup.held_locks() == [] and not lock.exists()
        assert {s: signal.getsignal(s) for s in before} == before
        baton = FileBaton(str(lock))
        assert baton.try_acquire()
        os.remove(lock)  # by hand, while this process holds it open
        lock.write_text("someone else's")  # a new file at the same path
        assert startup.release_held_locks() == [] and lock.exists()
        assert startup.held_locks() == []
        os.close(baton.fd)
    assert {s: signal.getsignal(s) for s in before} == before
    # outside watch_op_locks nothing is recorded
    os.remove(lock)
    baton = FileBaton(str(lock))
    assert baton.try_acquire() and startup.held_locks() == []
    baton.release()


# ---- an extensions folder torch's loader cannot use ----------------------------------------

def test_an_unusable_extensions_dir_is_named_and_nothing_is_created(tmp_path):
    """A file, a path under a file, a folder that cannot be created (/proc refuses mkdir,
    even to root, whom os.access would answer yes): one HDETConfigError naming
    TORCH_EXTENSIONS_DIR and the value. A creatable path passes and is not created. The
    stale-lock scan of a file raises no NotADirectoryError."""
    import pytest

    from hdet_scale.errors import HDETConfigError

    a_file = tmp_path / "ok.json"
    a_file.write_text("{}")
    assert startup.stale_trainer_locks(str(a_file)) == []
    for root, text in [(a_file, "is a file"), (a_file / "x", f"cannot be created: {a_file} is a file"),
                       ("/proc/hdetx", "cannot be created in /proc"),
                       # "" is the working directory to torch (ops rebuilt per folder)
                       ("", f"is empty: torch would build DeepSpeed's ops into the working directory ({os.getcwd()})"),
                       ("  ", "is empty")]:
        with pytest.raises(HDETConfigError) as e:
            startup.check_extensions_dir(str(root))
        assert f"TORCH_EXTENSIONS_DIR='{root}' {text}" in str(e.value), str(e.value)
    startup.check_extensions_dir(str(tmp_path / "new" / "ext"))
    startup.check_extensions_dir(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.json"]


# ---- what a torchrun rank prints, and exits with, when a signal ends it --------------------

RANK = r"""
import json, os, sys, time
from hdet_scale.train import stopping
mode, run_dir, announce = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
run = {"run_dir": run_dir, "train": {"checkpoint_every": 0}}
stopping.install_rank_handlers(run, announce)
if mode == "refused":  # cli.main: train() refused the input, the error printed; the launcher ends the job
    stopping.settle(2)
elif mode == "completed":  # train() wrote summary.json, then the signal (before it returned)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({"val_loss": 1.0}, f)
print("ready", flush=True)
time.sleep(60)
"""


def _rank(tmp_path, mode: str, announce: bool):
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", RANK, mode, str(tmp_path), "1" if announce else "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.stdout.readline() == "ready\n", child.communicate()
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=30)
    return child.returncode, err


def test_sigterm_after_a_refusal_or_the_summary_gives_no_resume_advice(tmp_path):
    """A refused rank (stopping.settle(2)) that the launcher then ends by SIGTERM exits 2
    and prints nothing (no "stopped by SIGTERM ...; continue with train.resume=true",
    advice just refused). SIGTERM once this attempt wrote summary.json exits 0, rank 0
    saying the run is complete (not 143 advising a resume that would then be refused). The
    reference: a summary.json from an earlier attempt (older than this process) still
    gives 143 and the stop line; a rank that does not announce prints nothing in every
    case."""
    for announce in (True, False):
        assert _rank(tmp_path, "refused", announce) == (2, "")
    rc, err = _rank(tmp_path, "completed", True)
    assert rc == 0 and "came after the run completed" in err and "resume=true" not in err, (rc, err)
    assert _rank(tmp_path, "completed", False) == (0, "")
    os.utime(tmp_path / "summary.json", (time.time() - 3600,) * 2)  # an earlier attempt's
    rc, err = _rank(tmp_path, "earlier", True)
    assert rc == 143 and "stopped by SIGTERM before its first step" in err, (rc, err)
    assert _rank(tmp_path, "earlier", False) == (143, "")


def _torchrun_ranks(monkeypatch, capsys, argv: list[str]) -> dict[str, str]:
    """cli.main(argv) in-process as ranks 0 and 1 of a 2-rank torchrun world (the variables
    torchrun sets); each must exit 2. Returns each rank's stderr."""
    from hdet_scale.train import cli

    for var, value in (("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(var, value)
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # torchrun's own mark (without one, every rank speaks)
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    lines = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert cli.main(argv) == 2
        lines[rank] = capsys.readouterr().err
    return lines


def test_under_torchrun_a_config_error_is_printed_by_rank_0_alone(monkeypatch, capsys):
    """Every torchrun rank validates the same command line; rank 0 prints the one error
    line, the others exit 2 silently (not N copies). In-process: cli.main with the
    variables torchrun sets."""
    lines = _torchrun_ranks(monkeypatch, capsys, ["wandb.enabled=false", "train.stpes=3"])
    assert lines["0"].count("hdet-train: error: train.stpes: unknown key") == 1, lines
    assert lines["1"] == "", lines


def test_torchrun_restarts_with_the_shared_store_are_refused_before_they_hang(monkeypatch, capsys):
    """Under torchrun --max-restarts=2 without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the
    first restart would fail to connect and the second wait until killed, with advice about
    MASTER_ADDR: refused at once, by rank 0 alone, naming the variable; with it set
    (torchrun then sets TORCHELASTIC_USE_AGENT_STORE=False) or without restarts the same
    command goes on to its own error."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    for restarts, shared, refused in (("2", "True", True), ("2", "False", False), ("0", "True", False)):
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", restarts)
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", shared)
        lines = _torchrun_ranks(monkeypatch, capsys, ["wandb.enabled=false", "train.stpes=3"])
        assert lines["1"] == "", lines
        if refused:
            assert lines["0"] == ("hdet-train: error: environment: torchrun --max-restarts=2 shares its rendezvous "
                                  "store with the ranks, and a restarted attempt then reads the dead attempt's "
                                  "addresses and cannot connect (it fails or hangs; pytorch issue 135712): set "
                                  "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 where torchrun starts (the scripts in "
                                  "launchers/ do), or run with --max-restarts=0\n"), lines
        else:
            assert lines["0"].count("hdet-train: error: train.stpes: unknown key") == 1, lines


def test_a_config_warning_is_printed_once_by_the_announcing_process(capsys, tmp_path):
    """One replica asked to spread is warned of once, not as Python's ``UserWarning`` 9
    times in a 2-rank run (every check that meets it, in the launcher and every rank):
    ``cli._validate_once`` prints it once as an ``hdet-train: warning:`` line where the
    run announces (the launcher, or rank 0 under torchrun) and nowhere else; a warning
    that is not one of ours passes through unchanged."""
    import warnings

    from hdet_scale.train import cli
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.loop import validate

    run = load_run_config(None, ["deepspeed.hdet.replicas=1", "backend=ddp", "data.max_bytes=200000",
                                 "wandb.enabled=false", f"run_dir={tmp_path / 'run'}"])

    def validate_and_more(run, world):
        warnings.warn("a library's own warning", UserWarning)
        return validate(run, world)

    for announce in (True, False):
        with warnings.catch_warnings(record=True) as outer:
            warnings.simplefilter("always")
            cli._validate_once(validate_and_more, run, 4, announce=announce)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if "1 replica with" in line]
        assert len(lines) == (1 if announce else 0), err
        assert not announce or lines[0].startswith("hdet-train: warning: hdet.replicas: 1 replica with")
        assert [str(w.message) for w in outer] == ["a library's own warning"]


def test_a_signal_repeated_at_once_is_one_stop_a_later_one_kills():
    """``timeout`` sends SIGTERM to the launcher and then to its process group, so the
    launcher sees two; taking the copy for a person's second Ctrl-C would SIGKILL a rank
    that holds a DeepSpeed op lock, which would then refuse every later start. A repeat
    within ``REPEAT_S`` is the same stop; one a second or more later kills."""
    from hdet_scale.train.launcher import REPEAT_S, StopSignals

    now = [100.0]
    stops = StopSignals(clock=lambda: now[0])
    assert not stops.add(signal.SIGTERM)
    now[0] += 0.3  # timeout's copy, the launcher's handler having run in between
    assert not stops.add(signal.SIGTERM)
    now[0] += REPEAT_S
    assert stops.add(signal.SIGINT)  # a person's second Ctrl-C
    assert stops.received == [signal.SIGTERM, signal.SIGTERM, signal.SIGINT]
    assert 0.5 <= REPEAT_S <= 2  # shorter than a person's two key presses, longer than a loaded machine's gap


def test_one_process_per_launch_names_a_stale_lock(tmp_path):
    # Ranks of one launcher share a parent: the first claim wins, a second is refused while
    # the first is held, and is free again once the holder is gone (nothing left on disk).
    lock = str(tmp_path / "fused_adam" / "lock")
    first = startup.claim_naming(lock)
    assert first not in (None, False)
    assert startup.claim_naming(lock) is False
    other = startup.claim_naming(str(tmp_path / "cpu_adam" / "lock"))  # another lock: its own claim
    assert other not in (None, False)
    first.close()
    other.close()
    again = startup.claim_naming(lock)
    assert again not in (None, False)
    again.close()
    assert not list(tmp_path.iterdir())


STOP_WHILE_CHECKING = """
import os, signal, sys, time
import hdet_scale.train.config as config
read = config.load_run_config
def load_run_config(*args):  # the signal arrives while the config is read and checked
    os.kill(os.getpid(), signal.{sig})
    time.sleep(30)  # a stop must not wait for this
    return read(*args)
config.load_run_config = load_run_config
from hdet_scale.train.cli import main
sys.exit(main(["train.steps=5", "run_dir={run_dir}"]))
"""


def test_sigterm_or_sighup_while_the_config_is_checked_gives_the_stop_line(tmp_path):
    """A SIGTERM to hdet-train within its first second or so (reading and checking the
    config, before the local launcher's handlers) does not end it with 143 and no line: it
    prints the line the launcher prints a moment later, and exits 128 + the signal, at
    once (within 25 s of the start, where the check it interrupts takes 30); nothing is
    left in run_dir. (In a child process: a regression would kill this one.)"""
    import subprocess
    import sys

    for sig in ("SIGTERM", "SIGHUP"):
        run_dir = tmp_path / sig
        t0 = time.monotonic()
        # SIGHUP at its default, as under a terminal: a suite run under nohup passes it on
        # ignored, and hdet-train then rightly goes on
        proc = subprocess.run([sys.executable, "-c", STOP_WHILE_CHECKING.format(sig=sig, run_dir=run_dir)],
                              capture_output=True, text=True, timeout=120,
                              preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
        assert proc.returncode == 128 + getattr(signal, sig), (proc.returncode, proc.stderr[-2000:])
        assert proc.stderr.strip() == f"hdet-train: stopped by {sig} before any rank started", proc.stderr
        assert time.monotonic() - t0 < 25 and not run_dir.exists()  # at once, not after the 30 s check


def test_a_world_left_in_the_environment_without_a_launcher_is_named(monkeypatch, capsys):
    """RANK/WORLD_SIZE/MASTER_* left in a shell would make hdet-train rank 0 of a world
    whose other ranks never come (nproc unused), silent for 60 s: rank 0 says so at once;
    under torchrun (TORCHELASTIC_RUN_ID), the deepspeed launcher (LOCAL_SIZE) or
    srun/mpirun nothing is added, and rank 1 stays quiet there. A leftover RANK=1 is not
    silent (no note, not even the config error): with no launcher, any rank is alone in its
    terminal and says what rank 0 says."""
    from hdet_scale.train import cli
    from hdet_scale.train.launcher import _LAUNCHER_MARKS

    from hdet_scale.train import refusals

    monkeypatch.setattr(refusals, "QUIET_RANK_WAIT_S", 0)  # a quiet rank's wait for its rank 0: none here
    for mark in _LAUNCHER_MARKS:
        monkeypatch.delenv(mark, raising=False)
    for k, v in {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29556", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)

    def said(rank: str) -> str:
        monkeypatch.setenv("RANK", rank)
        assert cli.main(["wandb.enabled=false", "train.stpes=3"]) == 2  # refused after the note: nothing starts
        return capsys.readouterr().err

    note = ("hdet-train: note: RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29556 are set in the environment "
            "and no launcher (torchrun, deepspeed, srun, mpirun) started this process: it joins that world as rank 0 "
            "and waits for the other ranks (nproc is not used)")
    assert said("0").startswith(note)
    err = said("1")
    assert err.startswith(note.replace("RANK=0", "RANK=1").replace("as rank 0", "as rank 1")), err
    assert "train.stpes" in err, err  # the refusal too, not a silent exit 2
    for mark in ("TORCHELASTIC_RUN_ID", "LOCAL_SIZE"):
        monkeypatch.setenv(mark, "x")
        err = said("0")
        assert "no launcher" not in err and "train.stpes" in err, err
        assert said("1") == ""  # a launcher's rank 1 leaves the words to its rank 0
        monkeypatch.delenv(mark)


def test_a_long_build_or_wait_is_noted_once_by_the_announcing_process(tmp_path, capfd):
    """A first DeepSpeed start with an empty extensions folder is not ~115 s of silence
    while local rank 0 itself builds ``fused_adam``: a build, as a wait on another's lock,
    is one line after ``waiting_note_s``; a process that does not announce says nothing.
    Real FileBatons; a child process holds the lock waited on."""
    import subprocess
    import sys

    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    for announce in (True, False):
        with startup.watch_op_locks(announce=announce, poll_s=0.05, waiting_note_s=0.3):
            baton = FileBaton(str(lock))
            assert baton.try_acquire()
            time.sleep(1.0)
            baton.release()
        err = capfd.readouterr().err
        want = (f"hdet-train: building DeepSpeed's fused_adam op for this machine (once per extensions folder; it "
                f"can take a few minutes, and later starts load it): {lock}\n")
        assert err == (want if announce else ""), err
    # Waits on two ops' locks, one after the other, as on a first start: the second,
    # fused_adam after shm_comm, is noted too (one note per lock, not per process).
    shm = tmp_path / "deepspeed_shm_comm" / "lock"
    shm.parent.mkdir()
    with startup.watch_op_locks(announce=True, poll_s=0.05, waiting_note_s=0.3):
        for held in (shm, lock):
            holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom torch.utils.file_baton import "
                                       f"FileBaton\nb = FileBaton({str(held)!r}); assert b.try_acquire(); "
                                       "print(flush=True)\ntime.sleep(1.5); b.release()"], stdout=subprocess.PIPE,
                                      text=True)
            holder.stdout.readline()  # it holds the lock now
            baton = FileBaton(str(held), wait_seconds=0.05)
            assert not baton.try_acquire()
            baton.wait()  # as torch's loader does while another process builds
            assert holder.wait(timeout=30) == 0
            err = capfd.readouterr().err
            op = held.parent.name
            assert err == (f"hdet-train: waiting for process(es) {holder.pid}, not a rank of this job (another run "
                           f"using this extensions folder) building DeepSpeed's {op} op for this machine (once per "
                           f"extensions folder; it can take a few minutes, and later starts load it): {held}\n"), err


def test_a_wait_on_the_jobs_own_rank_says_so(tmp_path):
    """"waiting for process(es) [6469]" does not leave the user to find out that 6469 is
    the job's other rank. Two sibling processes, as a launcher's ranks are: one holds
    the lock, the other waits on it and names it as this job's rank."""
    import subprocess
    import sys

    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    done = tmp_path / "done"  # the waiter has waited long enough: the holder releases (no race with start-up)
    holder = subprocess.Popen([sys.executable, "-c", "import os, time\nfrom torch.utils.file_baton import FileBaton\n"
                               f"b = FileBaton({str(lock)!r}); assert b.try_acquire(); print(flush=True)\n"
                               f"end = time.monotonic() + 60\nwhile not os.path.exists({str(done)!r}) and "
                               "time.monotonic() < end: time.sleep(0.05)\nb.release()"], stdout=subprocess.PIPE,
                              text=True)
    holder.stdout.readline()  # it holds the lock now
    waiter = subprocess.run([sys.executable, "-c", "import threading\nfrom torch.utils.file_baton import FileBaton\n"
                             "from hdet_scale.train import startup\n"
                             "with startup.watch_op_locks(announce=True, poll_s=0.05, waiting_note_s=0.3):\n"
                             f"    b = FileBaton({str(lock)!r}, wait_seconds=0.05); assert not b.try_acquire()\n"
                             f"    threading.Timer(1.5, open, ({str(done)!r}, 'w')).start(); b.wait()"],
                            capture_output=True, text=True, timeout=90)
    assert holder.wait(timeout=30) == 0 and waiter.returncode == 0, waiter.stderr
    assert waiter.stderr == (f"hdet-train: waiting for another rank of this job (process {holder.pid}) building "
                             "DeepSpeed's fused_adam op for this machine (once per extensions folder; it can take a few "
                             f"minutes, and later starts load it): {lock}\n"), waiter.stderr


def test_an_op_build_stopped_by_a_signal_is_told_from_a_failed_one():
    """A Ctrl-C while fused_adam compiles reaches ninja (the rank ignores SIGINT, its
    child does not); such a rank exits 130 quietly, without torch's ~60-line "Error
    building extension" traceback above the launcher's stop line; a compile that fails
    (exit 1) still raises. The chain as torch's loader raises it: RuntimeError from
    CalledProcessError."""
    import subprocess

    from hdet_scale.train.launcher import build_interrupted

    def loader_error(rc: int, said: str = "") -> RuntimeError:
        try:
            try:
                raise subprocess.CalledProcessError(rc, ["ninja", "-v"])
            except subprocess.CalledProcessError as e:
                raise RuntimeError("Error building extension 'fused_adam'" + said) from e
        except RuntimeError as e:
            return e

    for rc in (130, 143, 129, -2, -15):
        assert build_interrupted(loader_error(rc)), rc
    for rc in (1, 2, -9):
        assert not build_interrupted(loader_error(rc)), rc
    # ninja 1.13 exits 2 when its compiler died of the Ctrl-C first; its output, which torch
    # puts in the message, still says why
    assert build_interrupted(loader_error(2, ": [1/3] c++ ...\nninja: build stopped: interrupted by user.\n"))
    assert not build_interrupted(loader_error(1, ": FAILED: shm.o\nninja: build stopped: subcommand failed.\n"))
    assert not build_interrupted(RuntimeError("ninja: build stopped: interrupted by user."))  # no build error
    assert not build_interrupted(RuntimeError("Connection reset by peer"))
