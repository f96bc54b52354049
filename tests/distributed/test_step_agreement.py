"""Ranks in step: a skipped optimizer step still counts as an HDET step on every rank,
and ranks at different steps raise on every rank at the next sync, without hanging.

Two launches of 4 gloo ranks (2 replicas x 2 shards; ranks 0, 1 = replica 0), one
per backend (``step_workers``): DeepSpeed ZeRO-3, and DDP stepped by
``hdet_scale.backends.torch_step.optimizer_step`` (what hdet-train's TorchEngine.step calls
on FSDP2, DDP and fairscale).
In each, both gradient modes run twice from the same weights and batches: clean, and with
a real NaN gradient on rank 0 at step 4 (syncs every 3 steps, auto-LR off, 7 steps).

Tolerances: none. Everything compared is bit-identical by construction: the runs
execute the same operations on the same data up to the NaN, a replica that does not see
it runs the same operations afterwards too (in "replica" mode nothing crosses replica
groups between syncs), a skipped update leaves the weights untouched, and converge of
R = 2 replicas is ``(a + b) / 2`` in float32 (gloo sums two values, one rounding; the
divide by 2 is exact), or a copy of the one finite replica.
"""

from __future__ import annotations

import numpy as np
import pytest
import rank_tools
import step_workers as W
from rank_tools import WORLD

LAUNCH_TIMEOUT = 240  # harness deadline: kills every rank and names the stuck ones (a hang fails here)
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
STEPS, SYNC, NAN = W.STEPS, W.SYNC, W.NAN_STEP
NEXT_SYNC = 2 * SYNC


@pytest.fixture(scope="module")
def ds():
    pytest.importorskip("deepspeed")
    return rank_tools.launch(W.ds_worker, timeout=LAUNCH_TIMEOUT, env=rank_tools.DS_ENV)


@pytest.fixture(scope="module")
def ddp():
    return rank_tools.launch(W.ddp_worker, timeout=LAUNCH_TIMEOUT)


def check_skipped_step(res: list, sharing: str, nan_loss: bool) -> None:
    """``nan_loss``: rank 0 handed the scheduler a NaN loss for the skipped step (else the
    finite forward loss)."""
    clean = [r[f"{sharing}/clean"] for r in res]
    nan = [r[f"{sharing}/nan"] for r in res]
    skippers = set(range(WORLD)) if sharing == "global" else {0, 1}  # everyone / rank 0's replica
    for rank in range(WORLD):
        c, n = clean[rank], nan[rank]
        where = f"{sharing}, rank {rank}"
        # Every rank at the same HDET step after every step, skipped or not.
        assert c["hdet_step"] == n["hdet_step"] == list(range(1, STEPS + 1)), where
        assert all(c["applied"]), where
        assert n["applied"] == [t != NAN or rank not in skippers for t in range(1, STEPS + 1)], where
        # The skipped step still advanced the schedule: the LR trace is the clean run's.
        assert n["lrs"] == c["lrs"], where
        for t in range(1, NAN):
            np.testing.assert_array_equal(n["master"][t - 1], c["master"][t - 1], err_msg=where)
        if rank in skippers:
            # The skipped update left the weights as they were; the clean run moved them.
            np.testing.assert_array_equal(n["master"][NAN - 1], n["master"][NAN - 2], err_msg=where)
            assert not np.array_equal(c["master"][NAN - 1], c["master"][NAN - 2]), where
        else:
            # A replica that did not skip is untouched up to the next sync.
            for t in range(NAN, NEXT_SYNC):
                np.testing.assert_array_equal(n["master"][t - 1], c["master"][t - 1], err_msg=where)
        assert np.isfinite(n["master"][-1]).all(), where
        assert c["nonfinite"] == {SYNC: None, NEXT_SYNC: None}, where
        # A skipped step's loss is recorded as passed: a NaN one makes rank 0's replica
        # non-finite for the interval, a finite one leaves it in.
        assert n["nonfinite"] == {SYNC: None, NEXT_SYNC: [0] if nan_loss else None}, where
    # Converge at the next sync: replica 0 left out (every rank gets replica 1's
    # weights), or both averaged.
    cap = [n["captured"][NEXT_SYNC] for n in nan]
    if nan_loss:
        expected = [cap[2 + rank % 2] for rank in range(WORLD)]
    else:
        expected = [(cap[rank % 2] + cap[2 + rank % 2]) / np.float32(2) for rank in range(WORLD)]
    assert not np.array_equal(cap[0], cap[2]), "replicas equal before the sync: the check is vacuous"
    for rank in range(WORLD):
        np.testing.assert_array_equal(nan[rank]["master"][NEXT_SYNC - 1], expected[rank],
                                      err_msg=f"{sharing}: converge on rank {rank}")


@pytest.mark.parametrize("sharing", ["global", "replica"])
def test_deepspeed_skipped_step_counts_on_every_rank(ds, sharing):
    """DeepSpeed ZeRO-3 skips the update for a NaN gradient (the replica that saw it in
    "replica" mode, every replica in "global" mode); the backend still steps the HDET
    scheduler, so no rank falls behind and the run goes on past the next sync. Rank 0
    reports the NaN loss: its replica is left out of the next converge."""
    check_skipped_step(ds, sharing, nan_loss=True)


@pytest.mark.parametrize("sharing", ["global", "replica"])
def test_ddp_skipped_step_counts_on_every_rank(ddp, sharing):
    """DDP with ``optimizer_step``: a non-finite gradient norm skips the optimizer step on
    the ranks that share the gradient (clipping off in "global", on in "replica") and
    still steps the scheduler. The reported loss is finite: both replicas converge."""
    check_skipped_step(ddp, sharing, nan_loss=False)


def assert_mismatch(results: list, where: str, expected_steps: list[int]) -> None:
    for rank, r in enumerate(results):
        assert r["error"] is not None and r["error"]["type"] == "HDETStepMismatchError", f"rank {rank}: {r}"
        assert where in r["error"]["message"], r["error"]["message"]
        assert "another checkpoint" in r["error"]["message"]
        assert r["hdet_step"] == expected_steps[rank]
    assert len({r["error"]["message"] for r in results}) == 1, "ranks disagree on the verdict"


def test_deepspeed_rank_resumed_from_another_step_raises_on_every_rank(ds):
    """Rank 0 reloads an older HDET state (step 3 after step 6): three steps later it
    syncs at step 6 while the others sync at step 9, in the same iteration. Every rank
    raises the same error at that sync (no hang: the harness deadline)."""
    res = [r["resumed_elsewhere"] for r in ds]
    assert [r["at_iteration"] for r in res] == [9] * WORLD
    assert_mismatch(res, "step 6: rank 0; step 9: ranks 1, 2, 3", [6, 9, 9, 9])


def test_ddp_extra_scheduler_step_raises_on_every_rank(ddp):
    """Rank 0 calls scheduler.step once more than the others, then every rank syncs by
    hand: every rank raises, naming both steps."""
    assert_mismatch([r["extra_step"] for r in ddp], "step 1: ranks 1, 2, 3; step 2: rank 0", [2, 1, 1, 1])


def test_auto_lr_without_loss_fails_at_first_sync_on_every_rank(ddp):
    """Auto-LR scored by the training loss, first meta-update at step 6, no rank passes a
    loss: every rank raises at the first sync (step 3), before converge (no sync counted).
    A loss on one rank only is enough (the counts are all-reduced), and the probe fitness
    needs none: both go through the first sync."""
    for rank, r in enumerate(ddp):
        err = r["no_loss/train_loss"]
        assert err["error"] is not None and err["error"]["type"] == "HDETConfigError", f"rank {rank}: {err}"
        assert "step 3" in err["error"]["message"] and "train_loss" in err["error"]["message"]
        assert err["hdet_step"] == 3 and err["syncs"] == 0
        for case in ("no_loss/one_rank", "no_loss/probe"):
            assert r[case] == {"error": None, "hdet_step": 3, "syncs": 1}, f"{case}, rank {rank}"
