"""``hdet_scale.teardown``: a second job in the same processes, in a new world, runs as the
first did. What a notebook running two trainings needs, and what lets the tests reuse their
rank processes (``harness.run_ranks``). Runs on a fresh world (``run_fresh``): its subject
is what a process carries from one job to the next."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("deepspeed")

import ds_workers as W  # noqa: E402
import rank_tools  # noqa: E402
from harness import free_port, run_fresh  # noqa: E402


def test_after_teardown_a_second_job_in_a_new_world_equals_the_first():
    """The same job (a plain ZeRO-3 engine, then an HDET one) twice: bit-equal fp32
    masters of both engines on every rank (the same float operations on the same data;
    nothing of the first world enters the second). Teeth: with torch's
    destroy_process_group alone, DeepSpeed's group caches still hold the previous world's
    HDET mpu and the third job's plain engine fails."""
    env = {**rank_tools.DS_ENV, "HDET_TEST_PORTS": f"{free_port()},{free_port()}"}
    for r, res in enumerate(run_fresh(W.two_jobs_worker, rank_tools.WORLD, timeout=240, env=env)):
        for first, second in zip(res["first"], res["second"]):
            np.testing.assert_array_equal(second, first)
        assert "not registered" in (res["error"] or ""), f"rank {r}: {res['error']}"
