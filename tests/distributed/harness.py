"""Runs a function on W real ranks (separate processes, gloo) with a deadline: the
launcher the benchmarks use too (``benchmarks/ranks.py``), under the name the tests import.

A hang fails the test after ``timeout`` seconds instead of eating CI's time: every rank
process is killed and the ranks that did not answer are named.
"""

from __future__ import annotations

from benchmarks.ranks import RankFailure, free_port, run_ranks

__all__ = ["RankFailure", "free_port", "run_ranks"]
