"""Runs a function on W real ranks (separate processes, gloo) with a deadline, on worlds
started once per test run and reused (``benchmarks.ranks.run_pooled``: one pool of ranks
per world size and environment; a call that fails or hangs retires its pool, and the next
call gets a fresh one). ``run_fresh`` starts a new world for one call, for a test whose
subject is a process' start.

A hang fails the test after ``timeout`` seconds instead of eating CI's time: every rank
process is killed and the ranks that did not answer are named.
"""

from __future__ import annotations

from benchmarks.ranks import RankFailure, free_port
from benchmarks.ranks import run_pooled as run_ranks
from benchmarks.ranks import run_ranks as run_fresh

__all__ = ["RankFailure", "free_port", "run_fresh", "run_ranks"]
