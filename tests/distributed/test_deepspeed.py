"""HDET on DeepSpeed ZeRO-3 across real ranks: 4 gloo ranks on CPU = 2 replicas x 2
shards (ranks 0, 1 = replica 0; ranks 2, 3 = replica 1; ranks s and 2 + s form replica
group s).

Each test is one launch of 4 rank processes (``ds_workers``: tiny MLP with a LayerNorm and a
persistent float buffer, AdamW, fixed per-rank batches from seeded generators); the ranks
return numpy data and the assertions run here. A 4-rank DeepSpeed launch costs ~10-15 s
(the first engine; more engines in the same launch cost ~0.5 s each); the bad-config
launches build no engine (~4 s each).

Tolerances, stated where used:

- Converge (R = 2) is checked bit for bit: gloo sums the two float32 values of every
  element (one rounding, commutative) and divides by 2 (exact), so numpy's
  ``(a + b) / 2`` in float32 reproduces it exactly.
- HDET (spread 0, global gradients) vs plain ZeRO-3 over 4 ranks: rtol 1e-5, atol 1e-6.
  The same 4 gradients are averaged in a different order (reduce-scatter over 2 then
  all-reduce over 2, vs one reduce-scatter over 4): last-bit float32 differences, which
  Adam's normalised update keeps at ~1e-7 relative per step; measured max |diff| ~6e-8
  after 7 steps at lr 1e-2. The "replica" mode differs by ~lr (1e-2).
- Resume: exact (bitwise), same operations on the same data in the same order.
"""

from __future__ import annotations

import functools
import math
import os
import time

import numpy as np
import pytest

pytest.importorskip("deepspeed")

import torch  # noqa: E402

import ds_workers as W  # noqa: E402
import rank_tools  # noqa: E402
from rank_tools import REPLICAS, S, WORLD, assert_all_equal, replica_of  # noqa: E402

LAUNCH_TIMEOUT = 240  # harness deadline: kills every rank and names the stuck ones
# pytest-timeout is only the backstop: it must fire after the harness deadline.
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
OFF = [-1.0, 1.0]  # spread offsets of R = 2 (axes.spread_offsets)
launch = functools.partial(rank_tools.launch, timeout=LAUNCH_TIMEOUT, env=rank_tools.DS_ENV)


def reference_forward(flat: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """TinyNet's output on the probe input with the given flat parameters."""
    return rank_tools.reference_forward(W.build_model(), flat, W.probe_input(), dtype)


# ---- 1 -----------------------------------------------------------------------------------

def test_persistent_gather_equals_deepspeeds_own():
    """``ds_gather.gather_persistent`` (refresh after converge: one all-gather for all
    persistent parameters) against DeepSpeed's ``param.all_gather`` (one per parameter),
    from the same rank-specific partitions: bit-equal full values (both only copy bytes),
    in fp32 and bf16, on every rank; one collective per dtype; the two shards' values
    both present (so the gather is not a rank's own partition repeated)."""
    res = launch(W.gather_worker)
    for case in ("fp32", "bf16"):
        r = [x[case] for x in res]
        for x in r:
            assert x["n"] > 1 and x["collectives"] == 1, case
            assert x["ours_dtype"] == x["deepspeed_dtype"], case
            for a, b in zip(x["ours"], x["deepspeed"]):
                np.testing.assert_array_equal(a, b, err_msg=case)
        for rank in range(WORLD):  # shards of one replica see the same full values
            for a, b in zip(r[rank]["ours"], r[replica_of(rank) * S]["ours"]):
                np.testing.assert_array_equal(a, b)
        big = max(range(r[0]["n"]), key=lambda i: r[0]["sizes"][i])
        assert not np.array_equal(r[0]["ours"][big], r[2]["ours"][big]), "replicas drew different partitions"


def test_converge_identity_and_mean():
    """After the sync step (inside engine.step), the full parameters are bit-identical on
    all 4 ranks and equal the mean of the two replicas' masters *after* that step's own
    optimizer update (captured in a wrapper around converge), the working copy (bf16 or
    fp32) is the cast of the averaged masters, the next forward pass reads it, and the
    persistent float buffer is averaged over each replica group. Two engines: bf16 with
    DeepSpeed's default persistence threshold (every tensor persistent) and global
    gradients; fp32 with threshold 0 (every tensor partitioned) and replica gradients."""
    res = launch(W.converge_worker)
    for case, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        r = [x[case] for x in res]
        msg = f"[{case}]"
        assert [x["dp_world_size"] for x in r] == [S] * WORLD, msg
        assert r[0]["working_dtype"] == str(dtype), msg
        for rank in range(WORLD):  # spread 0.5: LR 1e-2 * (1 -+ 0.5), one value per replica
            assert r[rank]["lrs"] == r[replica_of(rank) * S]["lrs"], msg
        assert sorted([r[0]["lrs"][0][0], r[2]["lrs"][0][0]]) == pytest.approx([0.005, 0.015]), msg

        # Just before the sync step: replicas differ, shards of one replica agree.
        pre = [x["pre_working"] for x in r]
        np.testing.assert_array_equal(pre[1], pre[0])
        np.testing.assert_array_equal(pre[3], pre[2])
        assert np.abs(pre[0] - pre[2]).max() > 1e-3, f"{msg} replicas did not diverge before the sync"
        assert np.abs(r[0]["pre_probe"] - r[2]["pre_probe"]).max() > 1e-3, msg

        # Masters that converge averaged: after the step-3 optimizer update.
        for x in r:
            assert [(c["step"], c["finite"]) for c in x["captured"]] == [(3, [True, True])], msg
            assert x["sync_step"] == 3 and x["nonfinite"] is None, msg
        m = [x["captured"][0]["master"] for x in r]
        np.testing.assert_array_equal(m[1], m[0])
        np.testing.assert_array_equal(m[3], m[2])
        assert np.abs(m[0] - m[2]).max() > 1e-3, msg
        expected = (m[0] + m[2]) / np.float32(2)  # exact (module docstring)
        assert expected.dtype == np.float32

        post = [x["post_master"] for x in r]
        assert_all_equal(post, f"{msg} fp32 masters after sync")
        np.testing.assert_array_equal(post[0], expected, err_msg=f"{msg} masters != replica mean")

        working = [x["post_working"] for x in r]
        assert_all_equal(working, f"{msg} working copy after sync")
        cast = torch.from_numpy(expected).to(dtype).float().numpy()
        np.testing.assert_array_equal(working[0], cast, err_msg=f"{msg} working copy != cast of averaged masters")

        # The next forward pass (run before any GatheredParameters) uses the averaged weights.
        probes = [x["post_probe"] for x in r]
        assert_all_equal(probes, f"{msg} forward after sync")
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: ~3 significant digits on O(1) outputs
        np.testing.assert_allclose(probes[0], reference_forward(expected, dtype), rtol=tol, atol=tol,
                                   err_msg=f"{msg} forward after sync does not use the averaged weights")

        # Persistent float buffer: averaged over each replica group (ranks s and 2 + s).
        for rank in range(WORLD):
            s = rank % S
            for name, (after, dt) in r[rank]["post_buffers"].items():
                a, b = r[s]["captured"][0]["buffers"][name][0], r[S + s]["captured"][0]["buffers"][name][0]
                assert np.abs(a - b).max() > 0, f"{msg} buffer {name} equal before the sync: test is vacuous"
                want = (a + b) / np.float32(2)
                if dt != "torch.float32":
                    want = torch.from_numpy(want).to(getattr(torch, dt.split(".")[1])).float().numpy()
                np.testing.assert_array_equal(after, want, err_msg=f"{msg} buffer {name} on rank {rank}")


# ---- 2 -----------------------------------------------------------------------------------

def test_spread0_global_sharing_equals_plain_zero3():
    """Spread 0 + gradient_sharing "global" on the 2 x 2 mesh follows plain ZeRO-3 data
    parallelism over all 4 ranks (same init, same per-rank batches, same constant LR) for 7
    steps spanning the syncs at steps 3 and 6; "replica" sharing does not, already before
    the first sync."""
    res = launch(W.equivalence_worker)
    r0 = res[0]
    assert r0["plain_dp_world_size"] == 4
    assert r0["global_dp_world_size"] == S and r0["replica_dp_world_size"] == S
    assert r0["global_syncs"] == [0, 0, 1, 1, 1, 2, 2]
    assert all(lr == [W.LR] for lr in r0["global_lrs"])
    for t in range(7):
        plain = [x["plain"][t] for x in res]
        hdet = [x["global"][t] for x in res]
        assert_all_equal(plain, f"plain step {t + 1}")
        assert_all_equal(hdet, f"hdet global step {t + 1}")  # spread 0 + shared grads: replicas never diverge
        np.testing.assert_allclose(hdet[0], plain[0], rtol=1e-5, atol=1e-6,
                                   err_msg=f"hdet (global, spread 0) != plain ZeRO-3 dp=4 after step {t + 1}")
    for t in (0, 1):  # before the first sync (step 3)
        plain = res[0]["plain"][t]
        for rank in (0, 2):
            diff = np.abs(res[rank]["replica"][t] - plain).max()
            assert diff > 1e-3, f"replica sharing matches plain DP at step {t + 1} (max diff {diff})"
        assert np.abs(res[0]["replica"][t] - res[2]["replica"][t]).max() > 1e-3


# ---- 3 -----------------------------------------------------------------------------------

def test_ranks_agree_on_permutations_and_base_values():
    """Auto-LR (the paper's controller: "paper", "train_loss", "independent"; warm-up 2,
    sync every 2 steps, spread 0.2) over two parameter groups plus a
    weight-decay axis: every rank holds the same permutations, base values, velocities
    and sync record at every step; ranks of one replica share their LRs; the replicas'
    LRs are base * (1 -+ 0.2) as the shared permutation says."""
    res = launch(W.agreement_worker)
    assert [x["replica"] for x in res] == [0, 0, 1, 1]
    groups = res[0]["num_groups"]
    assert groups == 2
    steps = len(res[0]["hist"])
    for t in range(steps):
        h = [x["hist"][t] for x in res]
        for key in ("permutations", "base", "velocity", "last_sync", "base_lr", "base_wd"):
            for rank in range(1, WORLD):
                assert h[rank][key] == h[0][key], f"step {t + 1}: {key} differs on rank {rank}"
        for rank in range(WORLD):
            assert h[rank]["next_lrs"] == h[replica_of(rank) * S]["next_lrs"], f"step {t + 1} rank {rank}"
        for g in range(groups):
            base = h[0]["base_lr"][g]
            perm = h[0]["permutations"][str(("lr", g))]
            for rank in range(WORLD):
                want = base * (1 + 0.2 * OFF[perm[replica_of(rank)]])
                assert h[rank]["next_lrs"][g] == pytest.approx(want, rel=1e-12), (t + 1, rank, g)
            got = sorted(h[r]["next_lrs"][g] for r in (0, 2))
            assert got == [pytest.approx(base * 0.8, rel=1e-12), pytest.approx(base * 1.2, rel=1e-12)]
            if t + 1 < steps:  # the values set after step t are the ones step t + 1 uses
                wd_perm = h[0]["permutations"][str(("weight_decay", g))]
                for rank in range(WORLD):
                    used = res[rank]["hist"][t + 1]["used"]
                    assert used["lr"][g] == h[rank]["next_lrs"][g]
                    want = h[0]["base_wd"][g] * (1 + 0.5 * OFF[wd_perm[replica_of(rank)]])
                    assert used["weight_decay"][g] == pytest.approx(want, rel=1e-12, abs=0)
    hist = res[0]["hist"]
    assert hist[-1]["last_sync"]["hdet/sync"] == 4 and hist[-1]["step"] == 9
    assert not hist[0]["base"] and all(h["base"] for h in hist[1:]), "auto-LR should start at the step-2 sync"
    for t in range(2, steps):  # after auto-LR starts, the base moves only at syncs (even steps)
        if (t + 1) % 2:
            assert hist[t]["base"] == hist[t - 1]["base"], f"base changed at non-sync step {t + 1}"
        else:
            assert hist[t]["base"] != hist[t - 1]["base"], f"no meta-update at sync step {t + 1}"
    # Permutations are redrawn (both orders occur) and drawn independently per group.
    lr0 = {tuple(h["permutations"][str(("lr", 0))]) for h in hist}
    assert lr0 == {(0, 1), (1, 0)}
    assert any(h["permutations"][str(("lr", 0))] != h["permutations"][str(("lr", 1))] for h in hist)


# ---- 4 -----------------------------------------------------------------------------------

def test_nan_loss_on_one_replica():
    """Replica 1 reports a NaN loss for the interval ending at the step-6 sync: the base LR
    stays finite, replica 1 gets softmax weight 0, and converge hands replica 1 the
    parameters of replica 0 (the non-finite replica is left out of the mean). The next
    interval (clean) averages both again."""
    res = launch(W.nan_worker)
    assert [x["replica"] for x in res] == [0, 0, 1, 1]
    for step in (3, 6, 9):
        recs = [{k: v for k, v in x["records"][step].items() if k != "lrs"} for x in res]  # lrs: per replica
        for rank in range(1, WORLD):  # NaN != NaN: compare the text
            assert repr(recs[rank]) == repr(recs[0]), f"step {step}: record differs on rank {rank}"
    rec3, rec6, rec9 = (res[0]["records"][s] for s in (3, 6, 9))
    assert "hdet/nonfinite_replicas" not in rec3 and "hdet/nonfinite_replicas" not in rec9

    assert rec6["hdet/nonfinite_replicas"] == [1]
    assert math.isnan(rec6["hdet/loss/replica_1"]) and math.isfinite(rec6["hdet/loss/replica_0"])
    assert rec6["hdet/weight/replica_1"] == 0.0 and rec6["hdet/weight/replica_0"] == 1.0
    base6 = rec6["base"][str(("lr", 0))]
    assert math.isfinite(base6) and base6 > 0
    assert math.isfinite(rec6["hdet/lr/group_0/velocity"]) and math.isfinite(rec6["hdet/lr/group_0/hypergradient"])
    for rank in range(WORLD):
        lr = res[rank]["records"][6]["lrs"][0]
        assert math.isfinite(lr) and lr in (pytest.approx(base6 * 0.8), pytest.approx(base6 * 1.2))

    cap6 = [next(c for c in x["captured"] if c["step"] == 6) for x in res]
    assert all(c["finite"] == [True, False] for c in cap6)
    m = [c["master"] for c in cap6]
    assert np.abs(m[0] - m[2]).max() > 1e-4, "replicas equal before the sync: test is vacuous"
    for rank in range(WORLD):
        np.testing.assert_array_equal(res[rank]["post_master"][6], m[0],
                                      err_msg=f"rank {rank} did not get replica 0's parameters")

    assert rec9["hdet/weight/replica_0"] > 0 and rec9["hdet/weight/replica_1"] > 0
    assert math.isfinite(rec9["base"][str(("lr", 0))])
    cap9 = [next(c for c in x["captured"] if c["step"] == 9) for x in res]
    assert all(c["finite"] == [True, True] for c in cap9)
    expected = (cap9[0]["master"] + cap9[2]["master"]) / np.float32(2)
    for rank in range(WORLD):
        np.testing.assert_array_equal(res[rank]["post_master"][9], expected)


# ---- 5 -----------------------------------------------------------------------------------

def test_exact_resume_and_checkpoint_layout(tmp_path):
    """bf16, persistence threshold 100 (Linear weights partitioned, the rest persistent),
    replica gradients, auto-LR after step 3 (default "log" controller, probe fitness),
    syncs at 3 and 6. Uninterrupted 8 steps vs
    4 steps + save + load into a fresh engine (other initial weights) + 4 steps: the same
    LR at every step, the same permutations, bit-identical final masters, working copy,
    buffers and scheduler state. Each replica has its own checkpoint folder, no file is
    written by two ranks, and a 4 x 1 layout refuses the checkpoint before any collective."""
    ckpt = tmp_path / "ckpt"
    res = launch(W.resume_worker, str(ckpt), True)
    optim = "bf16_zero"  # DeepSpeed's prefix of ZeRO optimizer files under bf16
    tag = res[0]["tag"]
    assert tag == f"global_step{W.RESUME_AT}" and all(x["tag"] == tag for x in res)
    assert np.abs(res[0]["B_master_at_save"] - res[2]["B_master_at_save"]).max() > 1e-5, \
        "replicas equal at the save step: the checkpoint would not prove per-replica state"
    for rank, r in enumerate(res):
        for step in range(1, W.RESUME_STEPS + 1):
            second = r["B_lrs"] if step <= W.RESUME_AT else r["C_lrs"]
            perms = r["B_perms"] if step <= W.RESUME_AT else r["C_perms"]
            assert second[step] == r["A_lrs"][step], f"rank {rank}: LR differs at step {step}"
            assert perms[step] == r["A_perms"][step], f"rank {rank}: permutations differ after step {step}"
        assert r["C_step_after_load"] == W.RESUME_AT
        assert np.abs(r["C_master_before_load"] - r["B_master_at_save"]).max() > 1e-2
        np.testing.assert_array_equal(r["C_master_after_load"], r["B_master_at_save"])
        np.testing.assert_array_equal(r["C_master"], r["A_master"], err_msg=f"rank {rank}: final masters")
        np.testing.assert_array_equal(r["C_working"], r["A_working"], err_msg=f"rank {rank}: final working copy")
        assert r["C_buffers"].keys() == r["A_buffers"].keys()
        for name in r["A_buffers"]:
            np.testing.assert_array_equal(r["C_buffers"][name][0], r["A_buffers"][name][0])
        assert r["C_state"] == r["A_state"], f"rank {rank}: scheduler state"
    state = res[0]["A_state"]  # the default "log" controller ran at 3 and 6, scored by the probe
    assert state["updates"] == 2 and state["log_m"][str(("lr", 0))] != 0
    assert "hdet/fitness/replica_1" in state["last_sync"]

    # DeepSpeed's zero_to_fp32.py in a replica folder looks for latest there
    for r in range(REPLICAS):
        assert os.readlink(ckpt / f"replica_{r}" / "latest") == os.path.join("..", "latest")
        assert (ckpt / f"replica_{r}" / "latest").read_text().strip() == tag
        # DeepSpeed copies its scripts into replica_0 only: every replica folder gets them
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            assert (ckpt / f"replica_{r}" / script).read_bytes() == (ckpt / "replica_0" / script).read_bytes(), script
    # Who wrote what: every rank (r, s) its own DeepSpeed shard files and HDET state in
    # replica_r/; rank 0 also DeepSpeed's recovery scripts, hdet_layout.json and latest.
    written = rank_tools.assert_single_writers(ckpt, [x["written"] for x in res])
    for rank in range(WORLD):
        r, s = replica_of(rank), rank % S
        mine = {f"replica_{r}/{tag}/zero_pp_rank_{s}_mp_rank_00_model_states.pt",
                f"replica_{r}/{tag}/{optim}_pp_rank_{s}_mp_rank_00_optim_states.pt",
                f"replica_{r}/{tag}/hdet_shard_{s}.pt"}
        extra = set(written[rank]) - mine
        assert mine <= set(written[rank]), f"rank {rank} wrote {sorted(written[rank])}"
        assert all(f.startswith("replica_0/zero_to_") for f in extra) and (rank == 0 or not extra), extra
    for r in range(REPLICAS):
        for s in range(S):
            for name in (f"zero_pp_rank_{s}_mp_rank_00_model_states.pt", f"{optim}_pp_rank_{s}_mp_rank_00_optim_states.pt",
                         f"hdet_shard_{s}.pt"):
                assert (ckpt / f"replica_{r}" / tag / name).is_file(), name

    rank_tools.assert_layout_refused([x["D_error"] for x in res])


# ---- 6 -----------------------------------------------------------------------------------

BAD = {"spread_ratio": "hdet.axes.lr.spread_ratio", "replicas": "hdet.replicas", "scheduler": "scheduler:",
       "unknown_key": "hdet.sync_intervall: unknown key"}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_fails_on_every_rank_without_hanging(case):
    """torch.distributed is up (as under a launcher); a bad config must raise
    HDETConfigError naming the key on every rank by itself, with no rank left waiting in
    a collective (the harness deadline would fire)."""
    t0 = time.monotonic()
    res = launch(W.bad_config_worker, case, timeout=60, allow_errors=True)
    elapsed = time.monotonic() - t0
    for rank, text in enumerate(res):
        assert isinstance(text, str) and text.startswith("HDETConfigError"), f"rank {rank}: {text!r}"
        message = text.split("\nTraceback")[0]
        assert BAD[case] in message, f"rank {rank}: {message}"
    assert elapsed < 60


def test_a_world_without_local_rank_joins_over_env_without_mpi():
    """``RANK``/``WORLD_SIZE``/``MASTER_*`` without ``LOCAL_RANK`` (a shell's leftovers,
    or ranks started by hand): DeepSpeed's MPI discovery is not asked for (no mpi4py here:
    it would raise ModuleNotFoundError), and the 4 ranks form the env:// world:
    every rank sees 4 ranks and the all-reduced rank sum 0+1+2+3 = 6 (exact in float32);
    LOCAL_RANK is set to 0 on CPU, so zero.Init and the engine train."""
    res = launch(W.no_local_rank_worker, timeout=120)
    for out in res:
        assert (out["world"], out["rank_sum"], out["replicas"], out["local_rank"]) == (4, 6.0, 2, "0"), out
        # then 2 steps under zero.Init (no KeyError 'LOCAL_RANK'), bit-equal to
        # the same steps with the launcher's LOCAL_RANK: on CPU the index names one device
        np.testing.assert_array_equal(out["without"], out["with"])
    assert np.abs(res[0]["without"] - res[2]["without"]).max() > 0  # replicas at spread LRs diverged


# ---- gradient sharing overlapped with the backward pass --------------------------------

def test_overlapped_gradient_sharing_equals_the_hook():
    """``ds_overlap.py`` all-reduces each bucket's gradient partitions
    over the replica group as ZeRO-3 writes them during the backward pass of the last
    micro-batch, instead of the whole partition in a hook before the step. Against the
    hook, in the same launch, same data: the fp32 masters after every step bit-equal
    (R = 2: each element is the sum of two floats, whatever the chunking, then the same
    division), at 2 micro-batches per step (the first only accumulates) and in bf16 (whose gradient buffer is
    fp32 too). The overlapped runs did start collectives during the backward pass (some
    in flight when ZeRO's epilogue began, and when the optimizer step came) and more
    than one per step (one per bucket run); the replicas differ (spread 0.3), so equality is not that of a trivial run."""
    res = launch(W.overlap_worker)
    for case in ("fp32_gas2", "bf16_gas2"):
        for x in res:
            hook, over = x[f"{case}_hook"], x[f"{case}_overlap"]
            assert over["flat_dtype"] == "torch.float32" and over["overlapped"] and not hook["overlapped"], case
            assert len(over["started"]) == 4 and min(over["started"]) >= 1, (case, over["started"])
            # started during the backward pass of the last micro-batch: in flight before
            # ZeRO's epilogue reduced the last bucket (0 at the other micro-batches)
            assert max(over["before_epilogue"]) >= 1, (case, over["before_epilogue"])
            assert over["collectives"] > 4 * 2, (case, over["collectives"])
            for t, (a, b) in enumerate(zip(hook["masters"], over["masters"])):
                np.testing.assert_array_equal(a, b, err_msg=f"{case}: overlapped != hook after step {t + 1}")
        assert np.abs(res[0][f"{case}_overlap"]["masters"][-1] - res[2][f"{case}_overlap"]["masters"][-1]).max() > 0
