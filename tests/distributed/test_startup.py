"""A stale DeepSpeed op-build lock, planted in a private extensions folder, is named by the
ranks instead of hanging them: under ``torchrun`` (no ``hdet-train`` launcher to check
first), every rank waits in torch's ``FileBaton.wait`` on the lock, and each rank's
watchdog (``startup.watch_op_locks``) ends it with exit code 3, local rank 0 printing the
file and the fix once, within 60 s of the start. The lock is left where it was.

The folder is a copy of the ops this session built (``tests/conftest.py``), so only the
lock stands between the ranks and a normal start; the real ``~/.cache/torch_extensions``
is never touched. The launcher's own check before any rank starts: ``stale_op_lock`` in
test_bad_inputs.py.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import pytest
from cli_processes import run_cli

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
           "-m", "hdet_scale.train.cli", f"run_dir={tmp_path / 'run'}", "wandb.enabled=false", "train.progress=false"]
    rc, err, seconds, leftovers = run_cli(cmd, {"TORCH_EXTENSIONS_DIR": str(ext)}, timeout=120)
    assert rc != 0 and "exitcode  : 3" in err, (rc, err[-3000:])
    named = [line for line in err.splitlines() if line.startswith("hdet-train: error:") and str(lock) in line]
    # One line per rank that found it (up to 2 here): torchrun ends the other rank as soon
    # as the first exits, so which ranks get to look is a race.
    assert 1 <= len(named) <= 2 and all(f"rm {lock}" in line for line in named), err[-3000:]
    assert seconds < 60 and not leftovers, (seconds, leftovers)
    assert lock.exists()
