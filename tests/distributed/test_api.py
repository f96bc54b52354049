"""One API on every engine: the README's loop (``hdet_scale.prepare`` -> ``Ensemble``:
``accumulate`` / ``backward`` / ``step`` / ``save_checkpoint`` / ``load_checkpoint``) on
DDP, fairscale OSS, FSDP2 and DeepSpeed ZeRO-3, 4 real gloo ranks (2 replicas x 2
shards), one launch (``api_workers.run``).

Each engine runs the same 4 optimizer steps (accumulation 2, clipping 0.5, LR spread 0.5,
converge every 2 steps) from the same weights on the same data, so they must end with the
same weights; and a new ``Ensemble`` that loads the step-2 checkpoint must continue as
the uninterrupted one.

Tolerances: across engines rtol 1e-5, atol 1e-6 (the same gradients averaged in
another order and by other Adam kernels: float32 rounding; an engine that applied the
wrong LR, scale or clipping differs by ~lr = 1e-2 after 4 steps). Resume: atol 1e-6
(DDP over 4 ranks rebuilds its gradient buckets after the first iteration, so the sum
order can differ from the uninterrupted run's in the last bit; docs/backends.md).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("fairscale")

import api_workers as A  # noqa: E402
import rank_tools  # noqa: E402

LAUNCH_TIMEOUT = 300
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
launch = functools.partial(rank_tools.launch, timeout=LAUNCH_TIMEOUT, env=rank_tools.DS_ENV)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch(A.run, str(tmp_path_factory.mktemp("api")))


def test_the_same_loop_trains_the_same_weights_on_every_engine(runs):
    for rank, out in enumerate(runs):
        ref = out["ddp"]
        for backend in A.BACKENDS[1:]:
            np.testing.assert_allclose(out[backend]["final"], ref["final"], rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {rank}: {backend} differs from ddp")
            np.testing.assert_allclose(out[backend]["losses"], ref["losses"], rtol=1e-5)
    # the weights moved from the seeded start; step 4 is a sync: both replicas hold the average
    start = np.concatenate([p.detach().flatten().numpy() for p in rank_tools.build_model().parameters()])
    assert np.abs(runs[0]["ddp"]["final"] - start).max() > 1e-3
    for backend in A.BACKENDS:
        np.testing.assert_array_equal(runs[0][backend]["final"], runs[2][backend]["final"])


def test_checkpoints_take_the_same_arguments_and_resume_on_every_engine(runs):
    for rank, out in enumerate(runs):
        for backend in A.BACKENDS:
            r = out[backend]
            assert r["tag"] == r["loaded"] == "global_step2", (backend, r["tag"], r["loaded"])
            assert r["step"] == 4
            np.testing.assert_allclose(r["resumed"], r["final"], rtol=0, atol=1e-6,
                                       err_msg=f"rank {rank}: {backend} resumed differently")
            np.testing.assert_allclose(r["resumed_losses"], r["losses"][2:], rtol=1e-6)
    # the per-replica LRs after the run: 0.5x and 1.5x the base on the two replicas
    lrs = {runs[r]["deepspeed"]["replica"]: runs[r]["deepspeed"]["lr"] for r in range(4)}
    assert sorted(lrs.values()) == pytest.approx([0.5 * A.LR, 1.5 * A.LR], rel=1e-9)


def test_a_crafted_checkpoint_file_is_refused_on_every_rank_and_runs_nothing(runs):
    """Each kind of file a resume reads, per engine (``api_workers.CRAFTED``: HDET's state,
    DDP's model_optim.pt, fairscale's model.pt and OSS shard, DCP's .metadata and a
    non-tensor item inside a .distcp, DeepSpeed's model and optimizer states), replaced by
    a pickle whose load creates a folder, with the folder's manifest updated to match:
    every rank refuses the load with one ``HDETUntrustedFileError`` naming the file and the
    reference (``posix.mkdir``), and the folder is never created. The same ``Ensemble``
    then loads the clean checkpoint and continues as the uninterrupted run
    (``test_checkpoints_take_the_same_arguments_and_resume_on_every_engine``): nothing was
    loaded by the refused attempts."""
    for backend, kinds in A.CRAFTED.items():
        for name, _ in kinds:
            seen = [runs[r][backend]["crafted"][name] for r in range(4)]
            assert all(kind == "HDETUntrustedFileError" for kind, _, _ in seen), (backend, name, seen)
            assert len({msg for _, msg, _ in seen}) == 1, (backend, name, seen)  # one message, every rank
            msg = seen[0][1]
            assert f"/replica_1/global_step2/{name}" in msg and "posix.mkdir" in msg, msg
            assert not any(ran for _, _, ran in seen), (backend, name)


def test_replicas_start_from_one_model_when_ranks_build_other_weights(runs):
    """Each rank built TinyNet from its own seed (100 + rank) before ``prepare``. Every
    engine must start all 4 ranks from one model (exactly: a broadcast copies bits), and
    where the engine broadcasts whole models (DDP, fairscale: from global rank 0 to the
    world; DeepSpeed: from each shard group's first rank, then from replica 0 over the
    replica groups) that model is global rank 0's. FSDP2 keeps each rank's own chunk
    inside a replica, so its start is replica 0's two chunks, taken by replica 1: equal
    everywhere, but no single rank's build. Without the replica broadcast, DeepSpeed's
    replica 1 would keep rank 2's weights and FSDP2's replica 1 its own chunks. fc1 is
    frozen (outside DeepSpeed's optimizer partitions): DeepSpeed's replica 1 would keep its
    own fc1 if the start copy did not cover frozen parameters."""
    rank0 = np.concatenate([p.detach().flatten().numpy() for p in rank_tools.build_model(seed=100).parameters()])
    for backend in A.BACKENDS:
        for rank in range(1, 4):
            np.testing.assert_array_equal(runs[rank][backend]["seeded_apart"], runs[0][backend]["seeded_apart"],
                                          err_msg=f"{backend}: rank {rank} starts from other weights than rank 0")
        if backend != "fsdp2":
            np.testing.assert_array_equal(runs[0][backend]["seeded_apart"], rank0, err_msg=backend)



def test_ensemble_converge_averages_the_replicas_between_steps(runs):
    """Step 5 (no sync at T = 2) leaves the replicas apart; ``Ensemble.converge()`` gives
    every rank the mean of the two replicas' weights. Tolerance atol 1e-6: the mean is
    one float32 all-reduce over 2 ranks (exact up to the last bit of a sum and a halving)
    against numpy's mean of the same two arrays."""
    for backend in A.BACKENDS:
        apart0, apart1 = runs[0][backend]["apart"], runs[2][backend]["apart"]  # replica 0 and 1, shard 0
        assert np.abs(apart0 - apart1).max() > 1e-5, backend  # LR spread 0.5: they really parted
        for rank in range(4):
            np.testing.assert_allclose(runs[rank][backend]["converged"], (apart0 + apart1) / 2, rtol=0, atol=1e-6,
                                       err_msg=f"{backend}: rank {rank}")


def test_a_load_says_which_optimizer_settings_the_checkpoint_replaced(runs):
    """An Ensemble built with other betas and eps than its checkpoint's loads it and
    trains on with the checkpoint's, bit for bit (torch's load_state_dict restores each
    group's settings; hdet-train warns from its own config): every engine warns
    (HDETResumeWarning) naming each replaced setting, so that this is not without a
    word, and a load with the same settings warns of nothing: the LR, which HDET sets
    every step, is never named."""
    for backend in A.BACKENDS:
        w = runs[0][backend]["resume_warnings"]
        assert w["same"] == [], (backend, w["same"])
        assert w["betas_after"][0] == [0.9, 0.999], (backend, w)  # what torch's load does, shown
        assert len(w["changed"]) == 1, (backend, w["changed"])
        text = w["changed"][0]
        assert "group 0 betas: [0.5, 0.6] -> [0.9, 0.999]" in text and "group 0 eps: 1e-06 -> 1e-08" in text, text
        assert " lr:" not in text and "optimizer.param_groups[g][key] after load_checkpoint" in text, text
