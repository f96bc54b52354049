"""A metrics.jsonl that cannot be written (a file size limit, a full disk, a quota) ends
rank 0 with one HDETStateError naming the file, the cause and the way on, which hdet-train
prints as one ``hdet-train: error:`` line (under ``ulimit -f 8``: no ``OSError: [Errno 27]
File too large`` traceback from hdet_scale/logging.py)."""

from __future__ import annotations

import errno
import json
import resource
import subprocess
import sys

import pytest

from hdet_scale.errors import HDETStateError
from hdet_scale.logging import MetricsLogger

_LOG_UNDER_A_LIMIT = r"""
import sys

from hdet_scale.errors import HDETStateError
from hdet_scale.logging import MetricsLogger

logger = MetricsLogger(sys.argv[1], advice=lambda: "No checkpoint was saved yet.")
try:
    for step in range(1, 1000):
        logger.log({"hdet/loss": 1.0, "note": "x" * 100}, step=step)
except HDETStateError as e:
    print(e)
    sys.exit(2)
"""


def test_a_metrics_file_stopped_by_the_file_size_limit_is_one_state_error(tmp_path):
    """A real limit: a child process under RLIMIT_FSIZE (Python ignores SIGXFSZ, so the
    write fails with EFBIG). Its stderr stays empty: no traceback."""
    path = tmp_path / "run" / "metrics.jsonl"
    limit = 8192
    child = subprocess.run([sys.executable, "-c", _LOG_UNDER_A_LIMIT, str(path)], capture_output=True, text=True,
                           timeout=120, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert child.returncode == 2, (child.stdout, child.stderr)
    assert child.stderr == "", child.stderr
    msg = child.stdout.strip()
    assert msg.startswith(f"metrics: writing {path} failed, a file reached the file size limit of this process "
                          f"(ulimit -f: {limit} bytes) (OSError: [Errno {errno.EFBIG}] File too large"), msg
    assert msg.endswith("raise the limit (ulimit -f unlimited) first. No checkpoint was saved yet."), msg
    for line in path.read_text().splitlines()[:-1]:  # the records before are intact
        json.loads(line)


def test_a_full_disk_or_a_quota_under_the_metrics_file_is_one_state_error(tmp_path):
    logger = MetricsLogger("/dev/full", advice=lambda: "Last checkpoint: X.")
    with pytest.raises(HDETStateError, match=r"^metrics: writing /dev/full failed, the disk is full \(OSError: \[Errno "
                                             rf"{errno.ENOSPC}\] No space left on device\); free space first\. "
                                             r"Last checkpoint: X\.$"):
        logger.log({"hdet/loss": 1.0}, step=1)
    # the file is let go: nothing more is written, and neither this nor close() (whose flush
    # of the failed line would fail again) raises a second time
    logger.log({"hdet/loss": 1.0}, step=2)
    logger.close()

    class QuotaFile:
        def write(self, text):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")

        def close(self):
            pass

    logger = MetricsLogger(str(tmp_path / "metrics.jsonl"))
    logger._file = QuotaFile()
    with pytest.raises(HDETStateError, match=r"the disk quota is exceeded .*; free space within the quota \(or have "
                                             r"it raised\) first\.$"):
        logger.log({"hdet/loss": 1.0}, step=1)
    # any other failure is not the disk's: raised as it is
    with pytest.raises(IsADirectoryError):
        MetricsLogger(str(tmp_path)).log({"hdet/loss": 1.0}, step=1)
