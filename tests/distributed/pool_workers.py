"""Rank functions of test_rank_pool.py (spawned ranks import them by name)."""

from __future__ import annotations

import os


def pid() -> int:
    return os.getpid()


def refuse() -> None:
    """Every rank raises before any collective, as a config refusal does."""
    raise ValueError("refused on every rank")


def rank_0_leaves_the_others_waiting() -> None:
    """Rank 0 raises; the others wait in an all-reduce that never completes."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 failed")
    dist.all_reduce(torch.ones(1))


def rank_0_sleeps_while_the_other_waits() -> None:
    """Rank 0 never reaches the all-reduce rank 1 waits in: a hang."""
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))
