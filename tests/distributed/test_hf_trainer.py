"""The Hugging Face ``Trainer`` with an ``hdet`` block (``hdet_scale.hf.HDETTrainer``) on 4
real gloo ranks, DeepSpeed ZeRO-3 through Accelerate, against the plain ``Trainer``.

One launch (``hf_workers.run``, ~30 s) runs four ``train()`` calls on the same ranks; each
test below reads one part of what they returned. Layout under HDET: 2 replicas x 2
shards (ranks 0, 1 = replica 0; ranks 2, 3 = replica 1).

Tolerances, stated where used:

- spread 0, auto-LR off vs the plain ``Trainer`` (data parallel over 4) from the same
  weights: rtol 1e-5, atol 1e-6 after 4 steps. The same 16 sequences' gradients are averaged in another order
  (reduce-scatter over 2 shards, then all-reduce over 2 replicas, vs one reduce-scatter
  over 4): last-bit float32 differences; measured max |diff| 1.2e-7 on weights of
  magnitude up to 1. A wrong gradient scale (one replica's gradient, or a factor 2) moves
  weights by ~lr = 1e-3.
- The loss handed to auto-LR vs the loss ``Trainer`` logs: rel 1e-6. ``Trainer`` logs the
  mean over ranks of each step's summed micro-batch losses in float32; the test averages
  the 4 ranks' fed losses in float64.
- Converge and resume: exact (bitwise). Converge writes one float32 mean into both
  replicas; the resumed run repeats the same operations on the same data.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")


import hf_workers as H  # noqa: E402
import rank_tools  # noqa: E402

LAUNCH_TIMEOUT = 300
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
launch = functools.partial(rank_tools.launch, timeout=LAUNCH_TIMEOUT, env=rank_tools.DS_ENV)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch(H.run, str(tmp_path_factory.mktemp("hf")))


def test_bad_configs_are_refused_at_construction_on_every_rank(runs):
    """``HDETTrainer(...)`` refuses each bad config of ``hf_workers.BAD`` with an
    ``HDETConfigError`` naming the key, the same on all 4 ranks, before training."""
    for key in H.BAD:
        seen = [out["refused"][key] for out in runs]
        assert seen[0] is not None, f"{key}: accepted"
        assert seen[0][0] == "HDETConfigError" and key in seen[0][1], f"{key}: {seen[0]}"
        assert all(s == seen[0] for s in seen), f"{key}: ranks disagree: {seen}"


def test_spread0_without_auto_lr_equals_the_plain_trainer(runs):
    """HDETTrainer with spread 0 and auto-LR off computes what the plain ``Trainer`` does
    (global gradient sharing = data parallelism over all 4 ranks), with gradient
    accumulation 2 and clipping on, from the same start (rtol 1e-5, atol 1e-6, as above).
    Its model is built as a large one is, by ``from_config`` under
    ``hdet_scale.hf.zero_init``: each rank holds half of every parameter (its shard group
    has 2 ranks, not the world's 4), and every replica starts from replica 0's weights
    (transformers initialises ZeRO-3 partitions on global rank 0 only: replica 1 would
    start from zeros)."""
    for name, (local, numel) in runs[0]["partition_of"].items():
        assert local == -(-numel // 2), f"{name}: {local} of {numel} elements on one rank"
    for rank, out in enumerate(runs):
        np.testing.assert_array_equal(out["sharded_start"], runs[0]["sharded_start"],
                                      err_msg=f"rank {rank} started from other weights than replica 0")
        np.testing.assert_allclose(out["sharded"], out["plain_from_start"], rtol=1e-5, atol=1e-6,
                                   err_msg=f"rank {rank}: the partitioned build trained differently")
    assert np.abs(runs[0]["sharded_start"]).max() > 0.01
    assert np.abs(runs[0]["sharded"] - runs[0]["sharded_start"]).max() > 1e-4  # it trained


def test_replicas_train_at_spread_learning_rates_and_auto_lr_moves_the_base(runs):
    """Spread 0.2 on R = 2: at every step one replica's LR is 0.8 x the base and the
    other's 1.2 x (ratio 1.5, mean = base), the same on the two ranks of a replica; the
    base starts at ``learning_rate`` and auto-LR moves it after its first sync."""
    lrs = {rank: [row["lr"] for row in out["hdet"]["steps"]] for rank, out in enumerate(runs)}
    assert lrs[0] == lrs[1] and lrs[2] == lrs[3]
    pairs = np.array([lrs[0], lrs[2]])
    np.testing.assert_allclose(pairs.max(0) / pairs.min(0), 1.5, rtol=1e-9)
    assert sorted(pairs[:, 0]) == pytest.approx([0.8 * H.LR, 1.2 * H.LR], rel=1e-9)
    bases = pairs.mean(0)
    assert abs(bases[-1] / H.LR - 1) > 1e-3, f"auto-LR never moved the base LR: {bases}"
    assert runs[0]["hdet"]["base"] == runs[2]["hdet"]["base"]


def test_learning_rate_after_the_last_step_is_the_one_it_ran_with(runs):
    """The ``learning_rate`` ``Trainer`` logs after step s (``logging_steps=1``) is step
    s+1's, as the scheduler's ``get_last_lr`` then (the recorder's rows); after the last
    step (6, ``max_steps``) no step follows, and it is step 6's own, the one read after
    step 5 (not a value for a step past the run). The last sync's
    meta-update moved the optimizer's LR, so the two differ on every rank."""
    for rank, out in enumerate(runs):
        rows, logged = out["hdet"]["steps"], out["hdet"]["logged_lr"]
        assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
        assert logged[:5] == [row["lr"] for row in rows[:5]], f"rank {rank}"
        assert logged[5] == rows[4]["lr"], f"rank {rank}"
        assert out["hdet"]["next_lr"] == rows[5]["lr"] != logged[5], f"rank {rank}: the last update moved nothing"


def test_converge_makes_the_replicas_equal_at_every_sync(runs):
    """Right after each sync (every 2 optimizer steps) both replicas hold the same
    weights (bitwise); the spread made them differ before (else converge proves nothing)."""
    syncs = [row for row in runs[0]["hdet"]["steps"] if "params" in row]
    assert [row["step"] for row in syncs] == [2, 4, 6]
    for rank, out in enumerate(runs):
        other = runs[(rank + 2) % 4]
        for mine, theirs in zip(out["hdet"]["steps"], other["hdet"]["steps"]):
            if "params" in mine:
                np.testing.assert_array_equal(mine["params"], theirs["params"],
                                              err_msg=f"step {mine['step']}: replicas differ after converge")
    assert np.abs(runs[0]["plain_from_start"] - runs[0]["hdet"]["final"]).max() > 1e-5


def test_auto_lr_gets_the_step_loss_trainer_logs(runs):
    """The loss handed to auto-LR at each optimizer step (this rank's loss summed over
    its 2 micro-batches, each divided for accumulation) averaged over the 4 ranks is the
    loss ``Trainer`` logs for that step (``logging_steps=1``)."""
    fed = np.array([out["hdet"]["fed"] for out in runs], dtype=np.float64)
    assert fed.shape == (4, 6)
    np.testing.assert_allclose(fed.mean(0), runs[0]["hdet"]["logged_loss"], rtol=1e-6)
    assert np.ptp(fed, axis=0).max() > 1e-4  # the ranks saw different data


def test_trainer_resume_from_checkpoint_continues_bit_for_bit(runs):
    """``train(resume_from_checkpoint="checkpoint-2")`` in a new HDETTrainer ends with the
    uninterrupted run's weights and replays its LRs from step 3 on; the checkpoint holds
    the HDET layout of 2 replicas x 2 shards."""
    for rank, out in enumerate(runs):
        np.testing.assert_array_equal(out["resumed"]["final"], out["hdet"]["final"],
                                      err_msg=f"rank {rank}: resumed run differs")
        # a crafted Trainer file was refused first, on every rank, and ran nothing
        # (hf_workers.run; the same Trainer objects then resumed bit-equal, above)
        kind, msg = out["crafted"]
        assert kind == "HDETUntrustedFileError" and "checkpoint-2/rng_state_1.pth holds a reference to posix.mkdir" \
            in msg, out["crafted"]
        assert not out["crafted_ran"]
        resumed = [(row["step"], row["lr"]) for row in out["resumed"]["steps"]]
        assert resumed == [(row["step"], row["lr"]) for row in out["hdet"]["steps"]][2:]
    layout = runs[0]["hdet"]["layout"]
    assert (layout["replicas"], layout["shard_size"], layout["step"]) == (2, 2, 2)


def test_a_run_stopped_by_a_callback_between_syncs_ends_with_the_replicas_average(runs):
    """A callback sets ``should_training_stop`` at step 3 of 6 (sync every 2): the
    replicas had parted at step 3 (spread 0.2), and after ``train()`` every rank holds
    the mean of the two replicas' weights, logged as the final converge. Tolerance atol
    1e-7: one float32 all-reduce of two values and a halving, against numpy's (a+b)/2."""
    apart = [out["stopped_apart"] for out in runs]
    assert np.abs(apart[0] - apart[2]).max() > 1e-6  # replica 0 (rank 0) and 1 (rank 2), shard group gathered
    for rank, out in enumerate(runs):
        assert out["stopped"]["step"] == 3
        assert out["stopped"]["record"].get("hdet/final_converge") == 1, out["stopped"]["record"]
        np.testing.assert_allclose(out["stopped"]["final"], (apart[rank % 2] + apart[rank % 2 + 2]) / 2, rtol=0,
                                   atol=1e-7, err_msg=f"rank {rank}")


def test_schedule_free_equals_the_plain_trainer_and_saves_x(runs):
    """``TrainingArguments(optim="schedule_free_adamw")`` under HDETTrainer (ZeRO-3, 2 x 2,
    spread 0, auto-LR off) computes what the plain ``Trainer`` computes with the same
    optimizer on ZeRO-3 over the 4 ranks (one parameter group: ``hf_workers.schedule_free``):
    the training point y and the evaluation point x (``trainer.optimizer.eval()``),
    rtol 1e-5 / atol 1e-6 as the AdamW comparison above (the same gradients summed in
    another order). Teeth: x and y differ by > 1e-4, so an
    ``eval()`` that moved nothing would fail (as ZeRO-3 alone does: its client optimizer's
    groups are empty between steps). ``train()`` puts y back up to the two lerps'
    rounding (atol 1e-7 on weights < 1); ``save_model`` writes x, not y."""
    for rank, out in enumerate(runs):
        sf = out["schedule_free"]
        np.testing.assert_allclose(sf["y"], sf["plain_y"], rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}: y")
        np.testing.assert_allclose(sf["x"], sf["plain_x"], rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}: x")
        np.testing.assert_allclose(sf["y_again"], sf["y"], rtol=0, atol=1e-7)
        assert np.abs(sf["x"] - sf["y"]).max() > 1e-4
        np.testing.assert_array_equal(sf["x"], runs[0]["schedule_free"]["x"])  # every replica the same x
    # x read again after save_model's own eval()/train() round trip: y moved in its last
    # bits (each round trip, as above), x by ~1e-11. Measured: 2.9e-11.
    assert runs[0]["schedule_free"]["saved_minus_x"] < 1e-9
    assert runs[0]["schedule_free"]["saved_minus_y"] > 1e-4
