"""Rank 0's progress bar leaves nothing behind when a signal ends the rank (after Ctrl-C /
SIGTERM of hdet-train, with the default progress bar on, the resource tracker must not warn
of "1 leaked semaphore objects to clean up at shutdown" after the stop line: tqdm's default
lock is a multiprocessing RLock, a named semaphore)."""

from __future__ import annotations

import subprocess
import sys

_RANK = r'''
import os
import sys
import time


def rank(ready):
    from hdet_scale.train.loop import progress_bar

    progress_bar(30, 0)
    open(ready, "w").close()
    time.sleep(120)
'''

# What the launcher does (launcher.py): a spawned rank sharing its resource tracker, here
# ended by SIGTERM as the launcher ends its ranks on a stop.
_LAUNCHER = r'''
import os
import signal
import sys
import time
from multiprocessing import get_context, resource_tracker

sys.path.insert(0, sys.argv[1])
import bar_rank

if __name__ == "__main__":
    ready = os.path.join(sys.argv[1], "ready")
    ctx = get_context("spawn")
    resource_tracker.ensure_running()
    p = ctx.Process(target=bar_rank.rank, args=(ready,))
    p.start()
    deadline = time.monotonic() + 120
    while not os.path.exists(ready) and p.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(ready), "the rank did not start its bar"
    os.kill(p.pid, signal.SIGTERM)
    p.join()
    print("rank exit", p.exitcode)
'''


def test_a_rank_ended_by_sigterm_leaks_no_semaphore_of_its_progress_bar(tmp_path):
    (tmp_path / "bar_rank.py").write_text(_RANK)
    (tmp_path / "launcher.py").write_text(_LAUNCHER)
    # the resource tracker warns when the launcher's process ends: its whole stderr is read
    done = subprocess.run([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0 and "rank exit -15" in done.stdout, (done.stdout, done.stderr)
    assert "leaked semaphore" not in done.stderr, done.stderr
    assert "hdet-train" in done.stderr  # the bar was drawn
