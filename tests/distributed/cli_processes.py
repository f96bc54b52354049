"""Command-line launches in tests, and the processes they leave behind.

Every launch carries a unique marker in its environment, which its children (ranks,
multiprocessing's resource tracker, W&B's service) inherit; a process still carrying it
after the launch ended was left behind.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import psutil

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}


def with_marker(env: dict) -> tuple[dict, str]:
    tag = uuid.uuid4().hex
    return {**env, "HDET_TEST_MARKER": tag}, tag


def processes_with(tag: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("HDET_TEST_MARKER") == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def left_behind(tag: str, wait_s: float = 5.0) -> list[str]:
    """Command lines of the processes still carrying ``tag`` after ``wait_s`` (the time
    multiprocessing's resource tracker takes to see its parent's pipe close); kills them,
    so one failing test does not leak into the next."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = processes_with(tag)
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    names = []
    for p in alive:
        try:
            names.append(" ".join(p.cmdline())[:200])
            p.kill()
        except psutil.NoSuchProcess:
            continue
    return names


def run_cli(cmd: list[str], env: dict | None = None, timeout: float = 120):
    """Run ``cmd`` to its end: ``(exit code, stderr, seconds to exit, command lines of the
    processes left behind after 5 s)``."""
    from benchmarks.ranks import close_pools

    close_pools()  # an idle pooled world beside a timed launch crowds it (tests/distributed/harness.py)
    env, tag = with_marker({**ENV, **(env or {})})
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    return proc.returncode, proc.stderr, time.monotonic() - t0, left_behind(tag)


STANDIN_DEEPSPEED = r"""#!/usr/bin/env bash
# The deepspeed launcher's stand-in (no sshd or pdsh here): records its arguments, drops its
# own options up to --module M, and runs `python -m M` with the rest, as the real one runs
# it on each host. HDET_FAULT_KILL only on its first call: a fault in the first attempt.
calls="$(dirname "$0")/calls"
echo "$*" >> "${calls}"
if [[ $(wc -l < "${calls}") -gt 1 ]]; then unset HDET_FAULT_KILL; fi
while [[ $# -gt 0 && "$1" != "--module" ]]; do shift; done
module=$2
shift 2
exec "${PYTHON}" -m "${module}" "$@"
"""


def hostfile_standins(folder) -> dict:
    """Environment for ``launchers/deepspeed_hostfile.sh`` on this machine: a hostfile of one
    host, ``ssh`` that answers (the script's reachability check), a ``pdsh`` that exists, and
    the deepspeed launcher's stand-in above (its calls in ``folder/bin/calls``). What the
    script itself does (its checks, retries, signals, arguments) runs for real."""
    import sys

    bin_dir = folder / "bin"
    bin_dir.mkdir()
    for name, text in (("ssh", "#!/bin/sh\nexit 0\n"), ("pdsh", "#!/bin/sh\nexit 0\n"),
                       ("deepspeed", STANDIN_DEEPSPEED)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (folder / "hostfile").write_text("localhost slots=4\n")
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOSTFILE": str(folder / "hostfile"),
            "PYTHON": sys.executable}


def rank_processes(launcher_pid: int) -> list[psutil.Process]:
    """The live ranks of hdet-train's own launcher ``launcher_pid``, oldest first: the
    children of its fork server (``launcher.launch_local``)."""
    ranks = []
    try:
        servers = [c for c in psutil.Process(launcher_pid).children()
                   if "multiprocessing.forkserver" in " ".join(c.cmdline())]
        for server in servers:
            ranks += [r for r in server.children() if r.status() != psutil.STATUS_ZOMBIE]
    except psutil.Error:  # the launcher or its server gone, or a rank between two looks
        pass
    return sorted(ranks, key=lambda p: p.pid)
