"""Runs a function on W real ranks (separate processes, gloo) with a deadline: the one
launcher of the benchmarks and of the multi-process tests (``tests/distributed/harness.py``
re-exports it).

A hang fails after ``timeout`` seconds instead of eating CI's time: every rank process is
killed and the ranks that did not answer are named. Each rank gets the environment
``torch.distributed``'s ``env://`` init reads (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ...) and one thread; ``fn`` initialises its process group itself.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing import get_context
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, q: Any, args: tuple, env: dict) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1", **env})
    try:
        import torch
        torch.set_num_threads(1)
        q.put((rank, "ok", fn(*args)))
    except BaseException as e:  # report any failure, including SystemExit
        q.put((rank, "err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class RankFailure(RuntimeError):
    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__("\n".join(f"rank {r}: {m}" for r, m in sorted(errors.items())))


def run_ranks(fn: Callable, world: int, args: tuple = (), timeout: float = 300, env: dict | None = None,
              allow_errors: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` ranks; return each rank's result (index = rank).
    ``fn`` must be importable by name (a module-level function): ranks are spawned.

    Raises RankFailure if a rank raised (unless ``allow_errors``: then its entry is the
    error text), TimeoutError if any rank is still running after ``timeout`` s.
    """
    ctx = get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, q, args, env or {}), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world)) - set(results))
                raise TimeoutError(f"ranks {missing} still running after {timeout:.0f} s (hang?)")
            try:
                rank, status, value = q.get(timeout=min(left, 1.0))
                results[rank] = (status, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and p.exitcode]
                if dead:
                    raise RuntimeError(f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, (s, v) in results.items() if s == "err"}
    if errors and not allow_errors:
        raise RankFailure(errors)
    return [results[r][1] for r in range(world)]
