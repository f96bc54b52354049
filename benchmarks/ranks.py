"""Runs a function on W real ranks (separate processes, gloo) with a deadline: the
launcher of the benchmarks and of the multi-process tests (``tests/distributed/harness.py``
re-exports it), fresh (:func:`run_ranks`) or on reused worlds (:func:`run_pooled`).

A hang fails after ``timeout`` seconds instead of eating CI's time: every rank process is
killed and the ranks that did not answer are named. Each rank gets the environment
``torch.distributed``'s ``env://`` init reads (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ...) and one thread; ``fn`` initialises its process group itself.
"""

from __future__ import annotations

import atexit
import contextlib
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


class RankFailure(RuntimeError):
    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__("\n".join(f"rank {r}: {m}" for r, m in sorted(errors.items())))


def run_ranks(fn: Callable, world: int, args: tuple = (), timeout: float = 300, env: dict | None = None,
              allow_errors: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` new ranks; return each rank's result (index = rank).
    ``fn`` must be importable by name (a module-level function): ranks are spawned. The
    ranks end with the call (a :class:`RankPool` of one call).

    Raises RankFailure if a rank raised (unless ``allow_errors``: then its entry is the
    error text), TimeoutError if any rank is still running after ``timeout`` s.
    """
    pool = RankPool(world, env, reuse=False)
    try:
        return pool.run(fn, args, timeout, allow_errors)
    finally:
        pool.close()


# ---- reused worlds ------------------------------------------------------------------------

def _reset(env: dict, cwd: str, handlers: dict, seed: int, filters: list, showwarning: Any) -> None:
    """Return a rank process to where it was before the last function, as far as tests
    reach: no process group nor caches of one (``hdet_scale.teardown``), the environment,
    working folder, signal handlers, warning filters and torch's default RNG seed of a
    fresh process."""
    import signal
    import warnings

    import torch

    from hdet_scale import teardown

    teardown()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)
    warnings.filters[:] = filters
    warnings.showwarning = showwarning
    torch.manual_seed(seed)


def _serve(rank: int, world: int, tasks: Any, results: Any, env: dict, reuse: bool) -> None:
    """A pooled rank: runs ``(n, fn, args, port)`` tasks until it gets ``None`` or its
    parent is gone (a test run killed outright leaves no idle rank behind); without
    ``reuse``, one task and no reset."""
    import multiprocessing
    import signal
    import warnings

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", **env})
    import torch
    torch.set_num_threads(1)
    seed, cwd = torch.initial_seed(), os.getcwd()
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals()
                if s not in (signal.SIGKILL, signal.SIGSTOP)}
    filters, showwarning = list(warnings.filters), warnings.showwarning
    parent = multiprocessing.parent_process()
    while True:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return
            continue
        if task is None:
            return
        n, fn, args, port = task
        base = dict(os.environ)
        os.environ["MASTER_PORT"] = str(port)
        try:
            outcome = ("ok", fn(*args))
        except BaseException as e:  # report any failure, including SystemExit
            outcome = ("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        if not reuse:
            results.put((n, rank, *outcome))
            return
        try:
            _reset(base, cwd, handlers, seed, filters, showwarning)
        except BaseException as e:  # this call's failure, not the next test's: then leave
            results.put((n, rank, "err", f"resetting the rank after the call: {type(e).__name__}: {e}\n"
                                         f"{traceback.format_exc()}"))
            return
        results.put((n, rank, *outcome))


def _all_reduce_one() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


class RankPool:
    """``world`` rank processes with environment ``env``, started once and given one
    function after another: the start-up (importing torch, DeepSpeed, transformers: seconds
    per rank) is paid once per pool instead of once per call, as DeepSpeed's own test
    harness does with ``reuse_dist_env``. Between functions each rank destroys its process
    group (``hdet_scale.teardown``) and restores its environment, working folder, signal
    handlers, warning filters and RNG seed.

    A call that fails on any rank, or runs past its deadline, retires the pool (its
    processes are killed), so the next call starts a fresh world, never one left inside a
    collective. The exception: a call made with ``allow_errors`` (a test of a refusal on
    every rank) keeps the pool if a new process group and one all-reduce then succeed
    within 30 s. With ``reuse=False`` the ranks run one call and end (:func:`run_ranks`).
    """

    def __init__(self, world: int, env: dict | None = None, reuse: bool = True):
        ctx = get_context("spawn")
        self.world, self.reuse = world, reuse
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_serve, args=(r, world, self.tasks[r], self.results, env or {}, reuse),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()
        self.calls = 0
        self.alive = True

    def run(self, fn: Callable, args: tuple = (), timeout: float = 300,
            allow_errors: bool = False) -> list[Any]:
        """As :func:`run_ranks`, on this pool's ranks."""
        if not self.alive:
            raise RuntimeError("this rank pool was retired after a failed call; start a new one")
        self.calls += 1
        n, port = self.calls, free_port()
        for q in self.tasks:
            q.put((n, fn, args, port))
        results: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < self.world:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.world)) - set(results))
                    raise TimeoutError(f"ranks {missing} still running after {timeout:.0f} s (hang?)")
                try:
                    got, rank, status, value = self.results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in results]
                    if dead:
                        raise RuntimeError(f"ranks {dead} died with exit codes "
                                           f"{[self.procs[r].exitcode for r in dead]}") from None
                    continue
                if got == n:
                    results[rank] = (status, value)
        except BaseException:
            self.close()
            raise
        errors = {r: v for r, (s, v) in results.items() if s == "err"}
        if errors and not allow_errors:
            self.close()
            raise RankFailure(errors)
        if errors and self.reuse and not self._healthy():
            self.close()
        return [results[r][1] for r in range(self.world)]

    def _healthy(self) -> bool:
        """After a call in which ranks raised (a test of a refusal): a new process group
        and one all-reduce on every rank within 30 s, or the world is not reused."""
        try:
            return self.run(_all_reduce_one, timeout=30) == [float(self.world)] * self.world
        except Exception:
            return False

    def close(self) -> None:
        """Stop the ranks: a clean exit when idle, killed after 5 s otherwise."""
        if not self.alive:
            return
        self.alive = False
        for q in self.tasks:
            with contextlib.suppress(Exception):
                q.put(None)
                q.cancel_join_thread()  # a killed reader must not block this process' exit
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()


_pools: dict[tuple, RankPool] = {}


def run_pooled(fn: Callable, world: int, args: tuple = (), timeout: float = 300, env: dict | None = None,
               allow_errors: bool = False) -> list[Any]:
    """:func:`run_ranks` on a :class:`RankPool` kept per ``(world, env)`` for the rest of
    this process (closed at exit), started on first use and again after a call that
    failed."""
    key = (world, tuple(sorted((env or {}).items())))
    pool = _pools.get(key)
    if pool is None or not pool.alive:
        # One idle world at a time: each rank holds torch, DeepSpeed and transformers
        # (~0.5 GB), and several idle worlds crowd out the page cache that every other
        # process' imports read from.
        close_pools()
        pool = _pools[key] = RankPool(world, env)
    return pool.run(fn, args, timeout, allow_errors)


@atexit.register
def close_pools() -> None:
    """Stop every pooled world (the next :func:`run_pooled` starts a fresh one)."""
    for pool in _pools.values():
        pool.close()
    _pools.clear()
