"""A stale DeepSpeed op-build lock, planted in a private extensions folder, is named by the
ranks instead of hanging them: under ``torchrun`` (no ``hdet-train`` launcher to check
first), every rank waits in torch's ``FileBaton.wait`` on the lock, and each rank's
watchdog (``startup.watch_op_locks``) ends it with exit code 3, the first rank to find it
printing the file and the fix once, within 60 s of the start. The lock is left where it was.

The folder is a copy of the ops this session built (``tests/conftest.py``), so only the
lock stands between the ranks and a normal start; the real ``~/.cache/torch_extensions``
is never touched. The launcher's own check before any rank starts: ``stale_op_lock`` in
test_bad_inputs.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from cli_processes import ENV, left_behind, processes_with, run_cli, with_marker

from hdet_scale.train import startup

pytestmark = pytest.mark.timeout(300)


def test_ranks_name_a_stale_op_lock_instead_of_hanging(tmp_path):
    built = startup.extensions_dir()
    ext = tmp_path / "ext"
    for op in ("deepspeed_shm_comm", "fused_adam"):
        shutil.copytree(os.path.join(built, op), ext / op, ignore=shutil.ignore_patterns("lock"))
    lock = ext / "fused_adam" / "lock"  # loaded after the process groups and the model: late in start-up
    lock.write_text("")
    old = time.time() - 3600
    os.utime(lock, (old, old))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "hdet_scale.train.cli", f"run_dir={tmp_path / 'run'}", "wandb.enabled=false", "train.progress=false", "train.plots=false",
           "deepspeed.optimizer.type=AdamW"]  # DeepSpeed's own Adam: the fused_adam op is loaded
    rc, err, seconds, leftovers = run_cli(cmd, {"TORCH_EXTENSIONS_DIR": str(ext)}, timeout=120)
    assert rc != 0 and "exitcode  : 3" in err, (rc, err[-3000:])
    named = [line for line in err.splitlines() if line.startswith("hdet-train: error:") and str(lock) in line]
    # Exactly one line: the first rank to find it names it and holds its claim for 3 s; the
    # other exits silently meanwhile, or is ended by torchrun once the first exits.
    assert len(named) == 1 and f"rm {lock}" in named[0], err[-3000:]
    assert seconds < 60 and not leftovers, (seconds, leftovers)
    assert lock.exists()


# A stand-in for ninja, first on PATH: torch's loader runs ``ninja -v`` in <op folder> while it
# holds <op folder>/lock (a no-op when built). This one notes where it runs, then waits: a
# rank is held inside the lock window, deterministically, until the test signals.
NINJA_SHIM = """#!{python}
import os, sys, time
if sys.argv[1:2] != ["--version"]:  # torch's availability check: answered at once
    with open(os.environ["HDET_TEST_NINJA_MARK"], "a") as f:
        f.write(os.getcwd() + "\\n")
    time.sleep(120)
os.execv({real!r}, [{real!r}, *sys.argv[1:]])
"""


def test_a_signal_during_op_loading_leaves_no_lock(tmp_path):
    """SIGTERM to ``hdet-train`` (twice at once, as ``timeout`` sends it) while a rank
    holds an op-build lock (inside torch's loader, running ninja) must not leave the lock,
    on which every later start would fail (exit 3): the rank removes its own lock and stops
    its build before it ends: exit 143 well inside the launcher's 15 s grace (no SIGKILL
    needed), no ``lock`` anywhere in the (private) extensions folder, no process left
    behind (the ninja stand-in included), and the stop line says no step was trained
    ("before its first step")."""
    built = startup.extensions_dir()
    ext = tmp_path / "ext"
    for op in ("deepspeed_shm_comm", "fused_adam"):
        shutil.copytree(os.path.join(built, op), ext / op, ignore=shutil.ignore_patterns("lock"))
    shim_dir, mark = tmp_path / "bin", tmp_path / "ninja_ran"
    shim_dir.mkdir()
    (shim_dir / "ninja").write_text(NINJA_SHIM.format(python=sys.executable, real=shutil.which("ninja")))
    (shim_dir / "ninja").chmod(0o755)
    env, tag = with_marker({**ENV, "TORCH_EXTENSIONS_DIR": str(ext), "HDET_TEST_NINJA_MARK": str(mark),
                            "PATH": f"{shim_dir}{os.pathsep}{ENV['PATH']}"})
    cmd = [sys.executable, "-m", "hdet_scale.train.cli", f"run_dir={tmp_path / 'run'}", "nproc=2", "train.steps=10",
           "deepspeed.hdet.sync_interval=5", "deepspeed.hdet.auto.warmup_steps=5", "wandb.enabled=false",
           "train.progress=false", "train.plots=false", "data.max_bytes=200000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        # a rank holds <op>/lock and runs "ninja" under it (its line written, not only the
        # file created: CI read it empty once)
        while not (mark.exists() and mark.read_text().strip()):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no rank reached the op build in time"
            time.sleep(0.1)
        held = mark.read_text().split()[0]
        assert os.path.exists(os.path.join(held, "lock"))
        t0 = time.monotonic()
        # GNU timeout signals the launcher, then its whole group, so the launcher gets
        # SIGTERM twice; on a loaded machine its handler runs in between, and must not take
        # the second as a person's second Ctrl-C and SIGKILL the rank holding the lock,
        # which would stay. (Two signals before the handler runs are one to Python: the
        # 0.3 s gap makes the case certain.)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        seconds = time.monotonic() - t0
        while processes_with(tag) and time.monotonic() - t0 < 30:
            time.sleep(0.1)
    finally:
        leftovers = left_behind(tag, wait_s=0)
    assert proc.returncode == 143, (proc.returncode, err[-3000:])
    locks = [str(p) for p in ext.rglob("lock")]
    assert not locks, (locks, err[-3000:])
    assert not leftovers, leftovers
    assert seconds < 10, (seconds, err[-3000:])  # the ranks ended by themselves, not by the SIGKILL at 15 s
    lines = [line for line in err.splitlines() if line.startswith("hdet-train: stopped by")]
    assert len(lines) == 1 and "SIGTERM before its first step" in lines[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_torchrun_a_run_check_error_is_printed_once(tmp_path):
    """An error the run's own checks find (``loop.validate``: here the data path; the
    same files on every rank) is printed once, not by every torchrun rank: each rank
    runs the checks before ``train()`` and rank 0 alone prints: one line, exit 2 on each
    rank, nothing left behind."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "hdet_scale.train.cli", f"run_dir={tmp_path / 'run'}", "wandb.enabled=false",
           "data.path=/nonexistent/corpus"]
    rc, err, seconds, leftovers = run_cli(cmd, {}, timeout=120)
    lines = [line for line in err.splitlines() if line.startswith("hdet-train: error:")]
    assert rc != 0 and err.count("exitcode  : 2") >= 1, (rc, err[-3000:])
    assert len(lines) == 1 and "data.path: '/nonexistent/corpus' does not exist" in lines[0], err[-3000:]
    assert seconds < 60 and not leftovers, (seconds, leftovers)
