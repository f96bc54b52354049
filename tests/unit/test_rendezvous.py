"""The process-group rendezvous when a rank never joins.

A rank whose peers never come would wait in torch's TCPStore for 30 minutes with no output,
then die with a ``DistStoreError`` / ``DistNetworkError`` traceback. ``joining`` prints a
line every ``notice_every`` seconds naming the rank and the address, and turns the timeout
into one ``HDETConfigError``. A real gloo rendezvous in a subprocess, with torch's timeout
cut to 3 s (the only change from a run: 30 min is too long for a test) and notices every
0.5 s, alone: rank 0 waits for a client, rank 1 for a rank 0 that never listens.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent("""
    import datetime, sys
    import torch.distributed as dist
    from hdet_scale.backends.rendezvous import joining
    from hdet_scale.errors import HDETConfigError
    try:
        with joining(notice_every=0.5):
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    except HDETConfigError as e:
        print("REFUSED:", e, file=sys.stderr)
        sys.exit(2)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_lone_rank_says_it_waits_and_times_out_with_one_message(rank, tmp_path):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - t0
    notices = [line for line in proc.stderr.splitlines() if "still waiting for the process group" in line]
    refused = [line for line in proc.stderr.splitlines() if line.startswith("REFUSED:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    # 3 s of wait at one line per 0.5 s: at least 2 even on a loaded machine
    assert len(notices) >= 2, proc.stderr[-3000:]
    where = f"rank {rank} of WORLD_SIZE=2 at MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port}"
    assert all(where in line and "a rank has not joined" in line for line in notices), notices
    assert len(refused) == 1 and where in refused[0] and "did not form" in refused[0], refused
    assert "timed out" in refused[0].lower(), refused  # torch's own line kept: who joined / what it tried
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert seconds < 60, seconds


def test_a_port_in_use_is_no_timeout_and_passes_unchanged():
    """Only torch's timeouts are reworded: rank 0 whose MASTER_PORT another process holds
    gets torch's own DistNetworkError (hdet-train names it as a port to change)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "DistNetworkError" in proc.stderr, proc.stderr[-3000:]
    assert "REFUSED" not in proc.stderr


def test_while_an_op_is_built_the_notice_says_so():
    """On a first run a rank compiles DeepSpeed's ops inside ``init_distributed`` for
    minutes; the notice must not send the user to check MASTER_ADDR / MASTER_PORT then. A
    ``lock`` in an op folder of ``TORCH_EXTENSIONS_DIR`` (torch holds one while it builds) is
    named instead; without it, the network advice stays (the test above).

    The extensions folder is a private temporary folder, not pytest's ``tmp_path``: the
    lock must stay for the whole wait whatever else runs on the machine. A notice line is
    matched by its start, so a line that torch's C++ logging split is not mistaken for one
    without the lock."""
    with tempfile.TemporaryDirectory(prefix="hdet-op-lock-") as root:
        lock = os.path.join(root, "cpu_adam", "lock")
        os.mkdir(os.path.dirname(lock))
        open(lock, "w").close()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_free_port()), "TORCH_EXTENSIONS_DIR": root}
        proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
        still_there = os.path.exists(lock)
    notices = [line for line in proc.stderr.splitlines() if line.startswith("hdet_scale: still waiting")]
    assert still_there and proc.returncode == 2 and len(notices) >= 2, proc.stderr[-3000:]
    op_notices = [line for line in notices if f"a DeepSpeed op is being built on this machine ({lock})" in line]
    assert len(op_notices) >= 2, proc.stderr[-3000:]
    assert not [line for line in proc.stderr.splitlines()
                if "MASTER_ADDR, MASTER_PORT" in line and not line.startswith("REFUSED:")], proc.stderr[-3000:]
