"""The Hugging Face ``Trainer`` with an ``hdet`` block in ``fsdp_config``
(``hdet_scale.hf.HDETTrainer`` on FSDP2 through Accelerate) on 4 real gloo ranks,
against the plain ``Trainer`` on FSDP2.

One launch (``hf_fsdp_workers.run``, ~35 s) runs five ``train()`` calls on the same
ranks; each test reads one part of what they returned. Layout under HDET: 2 replica
groups x 2 shards (ranks 0, 1 = replica 0; ranks 2, 3 = replica 1). Accelerate 1.15
enables its FSDP plugin on GPUs only; the workers set it on CPU as it would on GPUs
(``hf_fsdp_workers.OnCPU``), the rest is Accelerate's and torch's own code.

Tolerances, stated where used:

- spread 0, auto-LR off (HSDP on the 2 x 2 mesh) vs the plain ``Trainer`` (FSDP2 over
  4) from the same seeded weights: rtol 1e-5, atol 1e-6 after 4 steps. The same 16
  sequences' gradients are averaged in another order (reduce-scatter over 2 shards,
  then all-reduce over 2 replicas, vs one reduce-scatter over 4): last-bit float32
  differences; measured max |diff| 1.5e-8. A wrong gradient scale (one replica's
  gradient, or a factor 2) moves weights by ~lr = 1e-3.
- The loss handed to auto-LR vs the loss ``Trainer`` logs: rel 1e-6 (as test_hf_trainer).
- Converge, resume and the saved model: exact (bitwise). Converge writes one float32
  mean into both replicas; the resumed run repeats the same operations on the same data;
  the saved model is a copy of replica 0's weights.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import hf_fsdp_workers as H  # noqa: E402
import rank_tools  # noqa: E402

LAUNCH_TIMEOUT = 300
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
launch = functools.partial(rank_tools.launch, timeout=LAUNCH_TIMEOUT, env=rank_tools.ENV)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch(H.run, str(tmp_path_factory.mktemp("hf_fsdp")))


def test_bad_setups_are_refused_at_construction_on_every_rank(runs):
    """Each bad setup of ``hf_fsdp_workers.refusals`` raises ``HDETConfigError`` at
    ``HDETTrainer(...)``, naming what is wrong, the same on all 4 ranks: an hdet block
    that would be ignored (Accelerate without FSDP, ``fsdp`` unset), FSDP1, a
    ``parallelism_config``, a misspelt key, replicas not dividing the world, a label
    smoothing axis (``Trainer``'s loss has one factor for all ranks)."""
    needles = {"runs without FSDP": "HDET would be off", "fsdp is not set": "fsdp is not set",
               "fsdp_config.version": "fsdp_config.version", "parallelism_config": "parallelism_config",
               "sync_intervall": "hdet.sync_intervall", "replicas": "hdet.replicas",
               "label_smoothing": "hdet.axes.label_smoothing: not applied by HDETTrainer",
               "'hdett'": "key 'hdett' looks like the hdet block"}
    for key, needle in needles.items():
        seen = [out["refused"][key] for out in runs]
        assert seen[0] is not None, f"{key}: accepted"
        assert seen[0][0] == "HDETConfigError" and needle in seen[0][1], f"{key}: {seen[0]}"
        assert all(s == seen[0] for s in seen), f"{key}: ranks disagree: {seen}"


def test_spread0_without_auto_lr_equals_the_plain_fsdp2_trainer(runs):
    """Spread 0, auto-LR off: HSDP on HDET's (replica, shard) mesh ends where the plain
    ``Trainer``'s FSDP2 over 4 ranks does (rtol 1e-5, atol 1e-6, as above)."""
    assert tuple(runs[0]["mesh_dims"]) == ("replica", "shard")
    for rank, out in enumerate(runs):
        np.testing.assert_allclose(out["spread0"], out["plain"], rtol=1e-5, atol=1e-6,
                                   err_msg=f"rank {rank}: HDET at spread 0 trained differently")
        np.testing.assert_array_equal(out["start"], runs[0]["start"])
    assert np.abs(runs[0]["spread0"] - runs[0]["start"]).max() > 1e-4  # it trained


def test_replicas_train_at_spread_learning_rates_and_auto_lr_moves_the_base(runs):
    """Spread 0.2 on R = 2: one replica's LR is 0.8 x the base and the other's 1.2 x at
    every step (ratio 1.5), the same on the two ranks of a replica; auto-LR moves the base."""
    lrs = {rank: [row["lr"] for row in out["hdet"]["steps"]] for rank, out in enumerate(runs)}
    assert lrs[0] == lrs[1] and lrs[2] == lrs[3]
    pairs = np.array([lrs[0], lrs[2]])
    np.testing.assert_allclose(pairs.max(0) / pairs.min(0), 1.5, rtol=1e-9)
    assert sorted(pairs[:, 0]) == pytest.approx([0.8 * H.LR, 1.2 * H.LR], rel=1e-9)
    assert abs(pairs.mean(0)[-1] / H.LR - 1) > 1e-3, "auto-LR never moved the base LR"
    assert runs[0]["hdet"]["base"] == runs[2]["hdet"]["base"]


def test_converge_makes_the_replicas_equal_at_every_sync(runs):
    """Right after each sync (every 2 optimizer steps) both replicas hold the same weights
    (bitwise); the spread made the run differ from the plain one (else converge proves
    nothing)."""
    syncs = [row["step"] for row in runs[0]["hdet"]["steps"] if "params" in row]
    assert syncs == [2, 4, 6]
    for rank, out in enumerate(runs):
        other = runs[(rank + 2) % 4]
        for mine, theirs in zip(out["hdet"]["steps"], other["hdet"]["steps"]):
            if "params" in mine:
                np.testing.assert_array_equal(mine["params"], theirs["params"],
                                              err_msg=f"step {mine['step']}: replicas differ after converge")
    assert np.abs(runs[0]["spread0"] - runs[0]["hdet"]["steps"][3]["params"]).max() > 1e-5


def test_replica_gradient_sharing_shards_on_the_shard_mesh_and_converges(runs):
    """``gradient_sharing: "replica"``: FSDP2 on the 1-D shard mesh (no collective across
    replicas between syncs); after the step-2 converge both replicas hold the same weights
    (bitwise), which the 2 steps at 0.8 x and 1.2 x the LR had made differ from spread 0's."""
    assert tuple(runs[0]["local"]["mesh_dims"]) == ("shard",)
    for rank, out in enumerate(runs):
        mine, theirs = out["local"]["steps"][-1], runs[(rank + 2) % 4]["local"]["steps"][-1]
        assert mine["step"] == 2
        np.testing.assert_array_equal(mine["params"], theirs["params"])


def test_auto_lr_gets_the_step_loss_trainer_logs(runs):
    """The loss fed to auto-LR at each optimizer step, averaged over the 4 ranks, is the
    loss ``Trainer`` logs for that step (rel 1e-6); the ranks saw different data."""
    fed = np.array([out["hdet"]["fed"] for out in runs], dtype=np.float64)
    assert fed.shape == (4, 6)
    np.testing.assert_allclose(fed.mean(0), runs[0]["hdet"]["logged_loss"], rtol=1e-6)
    assert np.ptp(fed, axis=0).max() > 1e-4


def test_checkpoint_holds_every_replica_and_replica_0s_model(runs):
    """``checkpoint-2`` holds the 2 x 2 layout at step 2, and its ``model.safetensors``
    (``save_model``) is replica 0's weights right after the step-2 converge, bitwise."""
    layout = runs[0]["hdet"]["layout"]
    assert (layout["replicas"], layout["shard_size"], layout["step"], layout["backend"]) == (2, 2, 2, "fsdp2")
    step2 = runs[0]["hdet"]["steps"][1]
    assert step2["step"] == 2
    np.testing.assert_array_equal(runs[0]["hdet"]["saved_model"], step2["params"])


def test_trainer_resume_from_checkpoint_continues_bit_for_bit(runs):
    """``train(resume_from_checkpoint="checkpoint-2")`` in a new HDETTrainer ends with the
    uninterrupted run's weights on every rank and replays its LRs from step 3 on."""
    for rank, out in enumerate(runs):
        np.testing.assert_array_equal(out["resumed"]["final"], out["hdet"]["final"],
                                      err_msg=f"rank {rank}: resumed run differs")
        resumed = [(row["step"], row["lr"]) for row in out["resumed"]["steps"]]
        assert resumed == [(row["step"], row["lr"]) for row in out["hdet"]["steps"]][2:]


def test_schedule_free_equals_the_plain_fsdp2_trainer(runs):
    """``optim="schedule_free_adamw"`` under HDETTrainer on FSDP2 (2 x 2, spread 0, auto-LR
    off) ends where the plain FSDP2 ``Trainer`` with the same optimizer does, at the
    training point y and at the evaluation point x (``trainer.optimizer.eval()``; HDET
    averages schedule-free's z with the weights at every sync), rtol 1e-5 / atol 1e-6 as
    above. Teeth: x and y differ by > 1e-4."""
    for rank, out in enumerate(runs):
        sf = out["schedule_free"]
        np.testing.assert_allclose(sf["hdet"]["y"], sf["plain"]["y"], rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}: y")
        np.testing.assert_allclose(sf["hdet"]["x"], sf["plain"]["x"], rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}: x")
        assert np.abs(sf["hdet"]["x"] - sf["hdet"]["y"]).max() > 1e-4
