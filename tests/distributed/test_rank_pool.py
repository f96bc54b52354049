"""The tests' rank pool (``benchmarks.ranks.RankPool``): a world is reused while it is
healthy, and replaced, never waited on, once a call leaves it inside a collective."""

from __future__ import annotations

import time

import pool_workers as P
import pytest
from benchmarks.ranks import RankFailure, RankPool


@pytest.fixture
def pool():
    p = RankPool(2, {"OMP_NUM_THREADS": "1"})
    yield p
    p.close()


def test_a_world_is_reused_after_success_and_after_a_refusal_on_every_rank(pool):
    """The same two processes answer again; a call in which every rank raised (allowed:
    the refusal is what such a test checks) passes the health all-reduce and keeps them."""
    first = pool.run(P.pid, timeout=60)
    assert pool.run(P.pid, timeout=60) == first
    errors = pool.run(P.refuse, timeout=60, allow_errors=True)
    assert all("refused on every rank" in e for e in errors)
    assert pool.alive and pool.run(P.pid, timeout=60) == first


def test_a_world_left_inside_a_collective_is_retired_not_waited_on(pool):
    """Rank 0 raises while rank 1 waits in an all-reduce: the call fails on the spot (rank
    0's reset closes its side, and gloo fails rank 1's all-reduce), the processes are
    killed, and a new pool answers from new processes."""
    first = pool.run(P.pid, timeout=60)
    with pytest.raises(RankFailure):
        pool.run(P.rank_0_leaves_the_others_waiting, timeout=60)
    assert not pool.alive and not any(p.is_alive() for p in pool.procs)
    fresh = RankPool(2, {"OMP_NUM_THREADS": "1"})
    try:
        assert set(fresh.run(P.pid, timeout=60)).isdisjoint(first)
    finally:
        fresh.close()


def test_a_hung_call_ends_at_its_deadline_and_retires_the_world(pool):
    """Rank 0 sleeps while rank 1 waits in an all-reduce (gloo's own timeout: 30 minutes):
    the call raises TimeoutError at its 5 s deadline (within 5-15 s on a loaded machine), and
    both processes are gone afterwards."""
    pool.run(P.pid, timeout=60)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        pool.run(P.rank_0_sleeps_while_the_other_waits, timeout=5)
    assert 5 <= time.monotonic() - t0 < 15
    assert not pool.alive and not any(p.is_alive() for p in pool.procs)
