"""HDET on plain DDP across real gloo ranks on CPU: ``OneCycleAutoLR`` (each rank one
replica) and ``initialize`` for ``R x S`` meshes.

Two launches, each shared by several tests through a module-scoped fixture
(``ddp_workers``: tiny MLP with a LayerNorm and a persistent float buffer, fixed per-rank
batches from seeded generators); the ranks return numpy data, the oracles run here:

- launch 1, 2 ranks (~10 s): OneCycleAutoLR plain and HDET, ``initialize`` 2 x 1 in
  "replica" mode, bad arguments;
- launch 2, 4 ranks = 2 replicas x 2 shards (~18 s): ``initialize`` in "replica" mode,
  exact resume, bad configs.

Tolerances, stated where used:

- Plain data parallelism (spread 0) vs one process on the concatenated batch: rtol 1e-5,
  atol 1e-6. The single process averages the gradient over 8 rows in one reduction, DDP
  averages two 4-row means: float32 summation order differs (~1e-7 relative per
  gradient element), and SGD with momentum carries it linearly; measured max |diff|
  ~2e-8 after 12 steps.
- HDET (R = 2) vs ``hdet_scale.Simulator``: bit for bit (measured max |diff| 0). With two
  replicas every cross-replica sum has two terms: IEEE addition is commutative (one
  rounding in either order) and dividing by 2 is exact, so DDP's gradient mean, the
  converge all-reduce and the simulator's sum-in-replica-order agree exactly. (With
  R > 2 a ring all-reduce sums in another order than the simulator: last-bit
  differences, then a tolerance would be needed.)
- Converge, "replica" mode without gradient all-reduce, and resume: exact, for the same
  reason (two-term sums) and because the same operations run on the same data.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ddp_workers as W
import rank_tools
from hdet_scale import Simulator
from rank_tools import one_thread  # the oracles compute with one thread, as the ranks do

LAUNCH_TIMEOUT = 120  # harness deadline: kills every rank and names the stuck ones
pytestmark = pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)  # backstop after the harness deadline


@pytest.fixture(scope="module")
def pair():
    return rank_tools.launch(W.pair_worker, world=2, timeout=LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ddp") / "ckpt"
    return ckpt, rank_tools.launch(W.mesh_worker, str(ckpt), world=4, timeout=LAUNCH_TIMEOUT)


def values_of(opt: torch.optim.Optimizer) -> list[dict]:
    return W.group_values(opt)


def assert_config_errors(results: list, want: dict) -> None:
    """Every rank reported exactly the cases of ``want``, each an HDETConfigError whose
    text contains the case's fragment."""
    for rank, x in enumerate(results):
        assert x["bad"].keys() == want.keys()
        for case, fragment in want.items():
            text = x["bad"][case]
            assert text.startswith("HDETConfigError") and fragment in text, f"rank {rank} {case}: {text}"


# ---- (a) ------------------------------------------------------------------------------

def test_plain_equals_onecycle_and_data_parallel(pair):
    """Spread 0, auto-LR off, 2 ranks: OneCycleAutoLR sets OneCycleLR's LR and momentum at
    every step on both ranks, builds no process group, and the DDP model follows one
    model trained on the concatenation of both ranks' batches."""
    with one_thread():
        model = W.build_model()
        opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
        ref = torch.optim.lr_scheduler.OneCycleLR(opt, **W.PLAIN)
        for t in range(1, W.PLAIN_STEPS + 1):
            for r in (0, 1):
                assert pair[r]["plain_values"][t - 1] == values_of(opt), f"rank {r}: LR/momentum at step {t}"
            xs, ys = zip(*(W.batch(r, t) for r in (0, 1)))
            opt.zero_grad()
            F.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
            opt.step()
            ref.step()
            np.testing.assert_array_equal(pair[0]["plain_params"][t - 1], pair[1]["plain_params"][t - 1])
            np.testing.assert_allclose(pair[0]["plain_params"][t - 1], W.flat_params(model), rtol=1e-5, atol=1e-6,
                                       err_msg=f"DDP + OneCycleAutoLR != single process at step {t}")
        assert pair[0]["plain_values"][-1] == values_of(opt)
    assert not pair[0]["plain_topology"] and not pair[1]["plain_topology"]


# ---- (b) ------------------------------------------------------------------------------

def _simulator() -> Simulator:
    # The documented argument mapping, written out by hand: loss_scale -> temperature,
    # lr_of_lr -> step_size, momentum_of_lr -> momentum, gamma derived ("auto"); the
    # paper's controller, fitness (training loss) and per-group exploration.
    k, a = W.HDET_KW, W.HDET_ARGS
    cfg = {"replicas": 2, "sync_interval": k["model_sync_interval"], "gradient_sharing": "global",
           "seed": k["seed"], "axes": {"lr": {"spread_ratio": k["ensemble_lr_spread_ratio"]}},
           "schedule": {"name": "onecycle", "total_steps": a["total_steps"], "max_lr": a["max_lr"],
                        "div_factor": a["div_factor"], "final_div_factor": a["final_div_factor"],
                        "cycle_momentum": True},
           "auto": {"enabled": True, "warmup_steps": k["auto_lr_warmup_steps"], "temperature": k["loss_scale"],
                    "momentum": k["momentum_of_lr"], "step_size": k["lr_of_lr"], "decay": "auto",
                    "controller": "paper", "fitness": "train_loss", "groups": "independent"}}
    return Simulator(W.build_model, lambda ps: torch.optim.AdamW(ps, **W.ADAMW), cfg)


def _loss_fn(t: int):
    def fn(model, r):
        x, y = W.batch(r, t)
        return F.mse_loss(model(x), y)
    return fn


def test_hdet_matches_simulator(pair):
    """Spread 0.2, auto-LR from step 6, sync every 3, AdamW with cycled beta1, DDP over
    both ranks (global gradients, buffers not synced by DDP): every rank's LR and beta1
    at every step, its parameters and buffer after every step, and every sync record
    equal the single-process simulator's replica (R = 2, global mode), bit for bit."""
    assert [x["hdet_replica"] for x in pair] == [0, 1]
    T = W.HDET_KW["model_sync_interval"]
    with one_thread():
        sim = _simulator()
        for t in range(1, W.HDET_STEPS + 1):
            for r in (0, 1):
                assert pair[r]["hdet_values"][t - 1] == values_of(sim.optimizers[r]), f"rank {r} step {t}"
            sim.step(_loss_fn(t))
            for r in (0, 1):
                np.testing.assert_array_equal(pair[r]["hdet_params"][t - 1], W.flat_params(sim.models[r]),
                                              err_msg=f"rank {r}: parameters after step {t}")
                for name, b in W.buffers(sim.models[r]).items():
                    np.testing.assert_array_equal(pair[r]["hdet_buffers"][t - 1][name], b, err_msg=name)
            if t % T == 0:
                want = rank_tools.clean_record(sim.scheduler.last_sync)
                for r in (0, 1):
                    assert pair[r]["hdet_records"][t] == want, f"rank {r}: sync record at step {t}"
        for r in (0, 1):
            assert pair[r]["hdet_values"][-1] == values_of(sim.optimizers[r])

    # Not vacuous: the replicas ran different LRs, diverged between syncs, were averaged
    # at every sync (buffers too), and auto-LR moved the base away from OneCycle.
    lr0 = [v[0]["lr"] for v in pair[0]["hdet_values"]]
    lr1 = [v[0]["lr"] for v in pair[1]["hdet_values"]]
    assert all(a != b for a, b in zip(lr0, lr1))
    for t in range(1, W.HDET_STEPS + 1):
        p0, p1 = pair[0]["hdet_params"][t - 1], pair[1]["hdet_params"][t - 1]
        b0, b1 = (x["hdet_buffers"][t - 1]["input_mean"] for x in pair)
        if t % T == 0:
            np.testing.assert_array_equal(p0, p1)
            np.testing.assert_array_equal(b0, b1)
        else:
            assert np.abs(p0 - p1).max() > 0 and np.abs(b0 - b1).max() > 0, f"step {t}"
    rec = pair[0]["hdet_records"]
    assert "hdet/lr/group_0/hypergradient" not in rec[3] and "hdet/lr/group_0/hypergradient" in rec[6]
    assert all(0.05 < rec[t]["hdet/weight/replica_0"] < 0.95 for t in (6, 9, 12, 15))  # weighs both replicas
    onecycle = [sim.scheduler.schedule.value(t, W.HDET_ARGS["max_lr"]) for t in range(1, W.HDET_STEPS + 1)]
    assert pair[0]["hdet_bases"][5] != pytest.approx(onecycle[5], rel=1e-3)


def test_state_is_rank_free_and_last_epoch_resume(pair):
    """Rank 0's state_dict loaded on both ranks gives each rank its own LR (the reference
    code stores the rank: every rank would get rank 0's multiplier); last_epoch = 7
    (auto-LR off) replays the same LRs as the uninterrupted run; step() without the loss
    while auto-LR needs it is refused on every rank, leaving the state unchanged."""
    for x in pair:
        assert x["state_from_rank0_lrs"] == x["own_lrs"]
        assert x["resume_a"] == x["resume_b"]
        assert x["no_loss_error"] is not None and "scheduler.step(loss)" in x["no_loss_error"]
        assert x["step_after_no_loss"] == W.HDET_STEPS
    assert pair[0]["own_lrs"] != pair[1]["own_lrs"]


def test_replica_mode_single_shard_keeps_gradients_local(pair):
    """initialize 2 x 1, "replica" mode: both ranks start from rank 0's weights (their
    own inits differ), train on their own data with no gradient all-reduce (bitwise equal
    to one process training alone) until the step-4 converge, which leaves both ranks on
    the exact mean."""
    with one_thread():
        start = W.build_model(seed=10)
        init = W.flat_params(start)
        for x in pair:
            np.testing.assert_array_equal(x["s1_init"], init)
        for r, x in enumerate(pair):
            model = W.build_model(seed=10)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for t in range(1, 4):
                xb, yb = W.batch(r, t)
                opt.zero_grad()
                F.mse_loss(model(xb), yb).backward()
                opt.step()
                np.testing.assert_array_equal(x["s1_params"][t - 1], W.flat_params(model),
                                              err_msg=f"rank {r} step {t}: gradients were shared")
    cap = [x["s1_captured"] for x in pair]
    assert [c["step"] for c in cap[0]] == [4]
    mean = (cap[0][0]["params"] + cap[1][0]["params"]) / np.float32(2)  # two-term sum: exact
    assert np.abs(cap[0][0]["params"] - cap[1][0]["params"]).max() > 1e-4
    for x in pair:
        np.testing.assert_array_equal(x["s1_params"][3], mean)


def test_bad_arguments_fail_on_every_rank_before_any_collective(pair):
    want = {"sync_interval_zero": "model_sync_interval", "no_total_steps": "total_steps OR",
            "warmup_past_end": "auto_lr_warmup_steps", "world_size_mismatch": "world_size: is 4",
            "last_epoch_with_auto": "last_epoch"}
    assert_config_errors(pair, want)


# ---- (c) ------------------------------------------------------------------------------

def test_replica_groups_independent_and_converge_bit_identical(mesh):
    """2 x 2, "replica" mode, spread 0.3, sync at step 3. Shards of a replica stay equal;
    replica 0 does not see replica 1's data before the sync (a second run where replica 1
    trains on other batches leaves replica 0 bit-identical up to the converge); the
    converge leaves all four ranks on the exact mean of the two replicas, parameters and
    buffers."""
    _, res = mesh
    S = W.S
    assert [x["replica"] for x in res] == [0, 0, 1, 1]
    for run in ("same", "other"):
        for t in range(W.MESH_STEPS):
            p = [x[f"{run}_params"][t] for x in res]
            np.testing.assert_array_equal(p[1], p[0])
            np.testing.assert_array_equal(p[3], p[2])
            if t + 1 != 3:
                assert np.abs(p[0] - p[2]).max() > 1e-5, f"{run} step {t + 1}: replicas equal"
        cap = [x[f"{run}_captured"] for x in res]
        assert all([c["step"] for c in cs] == [3] for cs in cap)
        mean = (cap[0][0]["params"] + cap[S][0]["params"]) / np.float32(2)
        for rank in range(4):
            np.testing.assert_array_equal(res[rank][f"{run}_params"][2], mean, err_msg=f"{run} rank {rank}")
            before = [cap[s][0]["buffers"]["input_mean"] for s in (rank % S, S + rank % S)]
            assert np.abs(before[0] - before[1]).max() > 0
    for rank in (0, 1):  # replica 0: blind to replica 1's data until the converge
        for t in range(2):
            np.testing.assert_array_equal(res[rank]["same_params"][t], res[rank]["other_params"][t])
        np.testing.assert_array_equal(res[rank]["same_captured"][0]["params"], res[rank]["other_captured"][0]["params"])
    for rank in range(4):  # ... and sees it through the converge
        assert np.abs(res[rank]["same_params"][2] - res[rank]["other_params"][2]).max() > 1e-4
        for t in range(W.MESH_STEPS):  # LR = OneCycle * (1 -+ 0.3), one value per replica
            lr = res[rank]["same_lrs"][t][0]
            assert lr == res[(rank // S) * S]["same_lrs"][t][0]
            assert lr in (pytest.approx(res[0]["base"][t] * 0.7, rel=1e-12),
                          pytest.approx(res[0]["base"][t] * 1.3, rel=1e-12))
        assert res[0]["same_lrs"][0] != res[S]["same_lrs"][0]


# ---- (d) ------------------------------------------------------------------------------

def test_exact_resume_mid_interval(mesh):
    """2 x 2, replica mode, auto-LR after step 3 (the default "log" controller scored by
    probe loss), syncs at 3 and 6. 8 steps uninterrupted
    vs 4 steps + save_checkpoint + load_checkpoint into a fresh initialize (other initial
    weights) + 4 steps: the same LR at every step and bit-identical parameters, buffers,
    Adam state and scheduler state. Every file has one writer: shard rank 0 of each
    replica its model_optim.pt, every rank its hdet_shard_<s>.pt, rank 0 the layout. A
    4 x 1 layout refuses the checkpoint before any collective."""
    ckpt, res = mesh
    S = W.S
    tag = res[0]["tag"]
    assert tag == f"global_step{W.RESUME_AT}" and all(x["tag"] == tag and x["C_loaded_tag"] == tag for x in res)
    assert np.abs(res[0]["B_params"] - res[S]["B_params"]).max() > 1e-5, "replicas equal at save: vacuous"
    for rank, x in enumerate(res):
        for step in range(1, W.RESUME_STEPS + 1):
            second = x["B_lrs"] if step <= W.RESUME_AT else x["C_lrs"]
            assert second[step] == x["A_lrs"][step], f"rank {rank}: LR at step {step}"
        assert np.abs(x["C_before_load"] - x["B_params"]).max() > 1e-2
        np.testing.assert_array_equal(x["C_after_load"], x["B_params"])
        a, c = x["A"], x["C"]
        np.testing.assert_array_equal(c["params"], a["params"], err_msg=f"rank {rank}: parameters")
        np.testing.assert_array_equal(c["exp_avg_sq"], a["exp_avg_sq"], err_msg=f"rank {rank}: Adam state")
        for name in a["buffers"]:
            np.testing.assert_array_equal(c["buffers"][name], a["buffers"][name])
        assert c["sched"] == a["sched"], f"rank {rank}: scheduler state"
    sched = res[0]["A"]["sched"]
    assert sched["updates"] == 2 and sched["log_m"]["('lr', 0)"] != 0, \
        "auto-LR did not start: the resume would not cover its state"
    assert "hdet/fitness/replica_0" in sched["last_sync"], "the probe did not score the replicas"

    written = rank_tools.assert_single_writers(ckpt, [x["written"] for x in res])
    for rank in range(4):
        r, s = rank // S, rank % S
        mine = {f"replica_{r}/{tag}/hdet_shard_{s}.pt"} | ({f"replica_{r}/{tag}/model_optim.pt"} if s == 0 else set())
        assert set(written[rank]) == mine, (rank, written[rank])
    rank_tools.assert_layout_refused([x["D_error"] for x in res])


# ---- (e) ------------------------------------------------------------------------------

def test_bad_config_fails_on_every_rank_without_hanging(mesh):
    """torch.distributed up on 4 ranks; each bad config raises HDETConfigError naming its
    key on every rank by itself, with every collective and mesh creation forbidden (the
    optimizer-dependent check, a max_lr list of the wrong length, included)."""
    _, res = mesh
    want = {"replicas": "hdet.replicas", "spread_ratio": "hdet.axes.lr.spread_ratio",
            "unknown_key": "hdet.sync_intervall: unknown key", "max_lr_list": "hdet.schedule.max_lr",
            "process_group": "ddp_kwargs.process_group"}
    assert_config_errors(res, want)
