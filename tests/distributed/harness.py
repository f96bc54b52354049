"""Runs a function on W real ranks (separate processes, gloo) with a deadline, on a world
that is reused while calls keep the same world size and environment
(``benchmarks.ranks.run_pooled``: one idle world at a time; a call that fails or hangs
retires it, and the next call gets a fresh one). ``run_fresh`` starts a new world for one call, for a test whose
subject is a process' start. ``HDET_TEST_FRESH_RANKS=1`` makes every call a fresh world
(to rule the pool out when a test fails, or to time the suite without it).

A hang fails the test after ``timeout`` seconds instead of eating CI's time: every rank
process is killed and the ranks that did not answer are named.
"""

from __future__ import annotations

import os

from benchmarks.ranks import RankFailure, close_pools, free_port, run_pooled
from benchmarks.ranks import run_ranks as _run_ranks


def run_fresh(*args, **kwargs):
    """``benchmarks.ranks.run_ranks``: a new world for this call alone (the pooled one is
    stopped first, so that its idle ranks do not sit beside the new ones)."""
    close_pools()
    return _run_ranks(*args, **kwargs)


run_ranks = run_fresh if os.environ.get("HDET_TEST_FRESH_RANKS") == "1" else run_pooled

__all__ = ["RankFailure", "free_port", "run_fresh", "run_ranks"]
