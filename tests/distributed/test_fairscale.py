"""HDET on fairscale OSS + torch DDP across real ranks: 4 gloo ranks on CPU = 2 replicas x 2
shards (ranks 0, 1 = replica 0; ranks 2, 3 = replica 1; ranks s and 2 + s form replica
group s; OSS shards optimizer state over ranks {0, 1} and {2, 3}).

One launch of 4 rank processes runs every check (``fairscale_workers.all_worker``: tiny
MLP with a LayerNorm and a persistent float buffer, fixed per-rank batches from seeded
generators); process start-up dominates the cost (~10-20 s on 2 cores, the checks ~10 s).
The ranks return numpy data; the assertions run here, one test per property.

Tolerances, stated where used:

- Converge (R = 2) is checked bit for bit: gloo sums the two float32 values of every
  element (one rounding, commutative) and divides by 2 (exact), so numpy's
  ``(a + b) / 2`` in float32 reproduces it exactly.
- Spread 0 + global gradients vs plain DDP (4 ranks) + torch AdamW, and replica mode vs
  plain 2-rank DDP + AdamW: bitwise. Same DDP all-reduces (same group size, same bucket
  history) and the same per-tensor AdamW arithmetic; OSS only splits the tensors over
  two inner optimizers and broadcasts the results (copies); converging identical
  replicas gives ``(a + a) / 2 = a`` exactly.
- SGD update size: ``|(before - after) - lr * grad| <= ulp(after) + 2 eps |lr * grad|``
  per element: one float32 rounding of the update plus the product's.
- Resume: bitwise where DDP reduces over 2 ranks ("replica": a 2-value sum commutes) or
  does not rebuild its buckets. With "global" over 4 ranks, torch DDP rebuilds its
  gradient buckets after the first iteration of every process, so the first step after
  a resume reduces the same gradients in another element layout (gloo's ring order per
  element depends on its offset): last-bit differences in that step only (measured:
  Adam moments up to 7.5e-9 absolute on values ~0.1, parameters and LRs equal), bounded
  here by rtol 1e-5 / atol 1e-7. The training losses the scheduler accumulates and the
  losses and probe fitness the step-6 sync logs are float32 losses of such weights:
  rtol 1e-6, a few float32 ulps (measured: 9e-8 in the sum of the two losses since the
  step-6 sync, an ulp or two); the controller state derived from them agrees to 1e-9
  (the "log" controller's weights depend on the sign of the fitness gap only).
  ``ddp_kwargs={"find_unused_parameters": True}`` turns the rebuild off: bitwise again.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

pytest.importorskip("fairscale")

import fairscale_workers as W
import rank_tools
import torch
from rank_tools import S, WORLD, assert_all_equal, replica_of

LAUNCH_TIMEOUT = 180  # harness deadline: kills every rank and names the stuck ones
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT + 120)  # backstop after the harness deadline
MULT = (0.5, 1.5)  # spread 0.5, R = 2: multipliers 1 -+ 0.5
EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("fairscale_ckpt")
    res = rank_tools.launch(W.all_worker, str(root), timeout=LAUNCH_TIMEOUT)
    return res, root


def section(results, name: str) -> list:
    res, _ = results
    out = [r[name] for r in res]
    for rank, x in enumerate(out):
        assert not (isinstance(x, dict) and "error" in x), f"rank {rank}, section {name}:\n{x.get('error')}"
    return out


def same(a, b) -> bool:
    """Bitwise equality of nested dicts / lists / arrays / scalars."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def reference_forward(flat: np.ndarray) -> np.ndarray:
    """TinyNet's output on the probe input with the given flat parameters."""
    return rank_tools.reference_forward(W.build_model(), flat, W.probe_input())


# ---- 1. converge -------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["global", "replica"])
def test_converge_identity_mean_and_traffic(results, mode):
    """Spread 0.5, sync at step 3 (inside scheduler.step, after the step's update): full
    parameters bit-identical on all 4 ranks and equal to the replicas' exact mean; the
    next forward uses them; buffers averaged per replica group; optimizer state left
    alone; each rank all-reduces only its OSS partition (+ buffers) across replicas."""
    r = [x[mode] for x in section(results, "converge")]
    for rank in range(WORLD):
        assert r[rank]["replica"] == replica_of(rank)
        assert r[rank]["lrs"] == r[replica_of(rank) * S]["lrs"], f"rank {rank}: LRs differ inside its replica"
        assert r[rank]["sync_step"] == 3 and [c["step"] for c in r[rank]["captured"]] == [3]
    assert sorted([r[0]["lrs"][0][0], r[2]["lrs"][0][0]]) == pytest.approx([W.LR * m for m in MULT], rel=1e-12)

    # Before converge: OSS's broadcast keeps a replica's S ranks identical; replicas differ.
    for key, get in (("pre_params", lambda x: x["pre_params"]), ("captured", lambda x: x["captured"][0]["params"])):
        m = [get(x) for x in r]
        np.testing.assert_array_equal(m[1], m[0], err_msg=f"{key}: replica 0's shard ranks differ")
        np.testing.assert_array_equal(m[3], m[2], err_msg=f"{key}: replica 1's shard ranks differ")
        assert np.abs(m[0] - m[2]).max() > 1e-3, f"{key}: replicas did not diverge: test is vacuous"
    assert np.abs(r[0]["pre_probe"] - r[2]["pre_probe"]).max() > 1e-3

    m = [x["captured"][0]["params"] for x in r]
    expected = (m[0] + m[2]) / np.float32(2)  # exact (module docstring)
    assert expected.dtype == np.float32
    post = [x["post_params"] for x in r]
    assert_all_equal(post, "parameters after sync")
    np.testing.assert_array_equal(post[0], expected, err_msg="parameters != replica mean")

    # The next forward reads the averaged weights. 1e-6: the test process may run its
    # matmuls with other threads than the single-threaded ranks (O(1) outputs).
    probes = [x["post_probe"] for x in r]
    assert_all_equal(probes, "forward after sync")
    np.testing.assert_allclose(probes[0], reference_forward(expected), rtol=1e-6, atol=1e-6)

    # Persistent float buffer: averaged over each replica group (ranks s and S + s).
    for rank in range(WORLD):
        s = rank % S
        a, b = r[s]["captured"][0]["buffers"]["input_mean"], r[S + s]["captured"][0]["buffers"]["input_mean"]
        assert np.abs(a - b).max() > 0, "buffers equal before the sync: test is vacuous"
        np.testing.assert_array_equal(r[rank]["post_buffers"]["input_mean"], (a + b) / np.float32(2))

    # Optimizer state: each rank keeps its shard's moments through converge (not averaged).
    for rank in range(WORLD):
        assert same(r[rank]["post_state"], r[rank]["captured"][0]["state"]), f"rank {rank}: state changed"
    states_equal = same(r[0]["post_state"], r[2]["post_state"])
    # Shared gradients give identical moments on every replica (paper Sec. 3.1); replica
    # gradients give each replica its own.
    assert states_equal == (mode == "global")

    # Traffic: a rank all-reduces its OSS partition and its buffer (D_IN floats) over
    # the replica group, then the shard group re-broadcasts every bucket (full model).
    total = r[0]["total_numel"]
    assert r[0]["owned_numel"] + r[1]["owned_numel"] == total
    assert 0 < r[0]["owned_numel"] < total
    for rank in range(WORLD):
        comm = r[rank]["captured"][0]["comm"]
        assert comm == {"all_reduce": r[rank]["owned_numel"] + W.D_IN, "broadcast": total}, (rank, comm)


# ---- 2. spread 0 + global == plain DDP; state sharded -------------------------------------

def test_spread0_global_equals_plain_ddp_and_state_is_sharded(results):
    """Spread 0, auto-LR off, gradient_sharing "global", syncs at 3 and 6: bitwise the
    same parameters as plain torch DDP over 4 ranks with a torch AdamW after each of 7
    steps. Each rank's inner optimizer holds state for its own parameters only; the two
    shard ranks of a replica partition the model."""
    e = section(results, "equivalence")
    assert e[0]["syncs"] == [0, 0, 1, 1, 1, 2, 2]
    for t in range(7):
        assert_all_equal([x["plain"][t] for x in e], f"plain DDP step {t + 1}")
        assert_all_equal([x["hdet"][t] for x in e], f"hdet step {t + 1}")
        np.testing.assert_array_equal(e[0]["hdet"][t], e[0]["plain"][t],
                                      err_msg=f"hdet (spread 0, global) != plain DDP + AdamW after step {t + 1}")
    sizes = e[0]["param_numel"]
    owned = [set(x["state"]) for x in e]
    assert owned[0] == owned[2] and owned[1] == owned[3], "replica-group peers must own the same partition"
    assert owned[0] and owned[1] and not owned[0] & owned[1], owned
    assert owned[0] | owned[1] == set(range(len(sizes)))
    for rank, x in enumerate(e):
        for i, st in x["state"].items():
            assert st["exp_avg"].size == st["exp_avg_sq"].size == sizes[i], (rank, i)
        assert x["state_numel"] == 2 * sum(sizes[i] for i in owned[rank]) < 2 * sum(sizes)


# ---- 3. replica mode: replicas do not interact between syncs ------------------------------

def test_replica_mode_equals_independent_ddp_per_replica(results):
    """gradient_sharing "replica", spread 0.5, no sync in 5 steps: each replica follows,
    bit for bit, a plain torch DDP + AdamW over its own 2 ranks (own process group) at the
    LR HDET gave it, from the same initial weights on the same batches."""
    iso = section(results, "isolation")
    assert iso[0]["syncs"] == 0
    assert sorted({x["lrs"][0][0] for x in iso}) == pytest.approx([W.LR * m for m in MULT], rel=1e-12)
    for rank, x in enumerate(iso):
        assert all(lr == x["lrs"][0] for lr in x["lrs"]), "constant schedule, no sync: LR must not move"
        for t in range(5):
            np.testing.assert_array_equal(x["hdet"][t], x["plain"][t],
                                          err_msg=f"rank {rank}: != independent 2-rank DDP after step {t + 1}")
    assert np.abs(iso[0]["hdet"][-1] - iso[2]["hdet"][-1]).max() > 1e-3


# ---- 4. per-replica hyperparameters reach the inner (sharded) optimizer -------------------

def test_sgd_update_size_is_lr_times_multiplier(results):
    """SGD, two parameter groups (peaks 0.01 and 0.02), spread 0.5, global gradients:
    every element's update equals -lr_{r,g} * grad (lr_{r,g} = peak_g * rho), including
    the elements another shard rank updated and broadcast; the inner optimizer ran with
    the LRs HDET wrote into OSS.param_groups."""
    sgd = section(results, "sgd")
    peaks = [W.LR, 2 * W.LR]
    for t in range(4):
        outer = [x["steps"][t]["outer_lrs"] for x in sgd]
        for rank in range(WORLD):
            assert outer[rank] == outer[replica_of(rank) * S]
            assert [g["lr"] for g in sgd[rank]["steps"][t]["inner"]] == outer[rank], f"rank {rank} step {t + 1}"
        for g in range(2):
            got = sorted([outer[0][g] / peaks[g], outer[2][g] / peaks[g]])
            assert got == pytest.approx(list(MULT), rel=1e-12), (t, g, got)
        for rank in range(WORLD):
            st = sgd[rank]["steps"][t]
            lr = np.asarray(st["outer_lrs"], dtype=np.float64)[np.asarray(sgd[rank]["group_of_param"])]
            want = lr * st["grad"]
            delta = st["before"].astype(np.float64) - st["after"]
            bound = np.spacing(np.abs(st["after"])) + 2 * EPS32 * np.abs(want)
            assert (np.abs(delta - want) <= bound).all(), \
                f"rank {rank} step {t + 1}: max excess {np.max(np.abs(delta - want) - bound)}"
            assert np.abs(want).max() > 1e-4, "vanishing gradient: test is vacuous"


def test_cycle_momentum_and_lr_reach_inner_optimizer(results):
    """OneCycle (20 steps) with cycle_momentum, spread 0.5, sync every 4 steps: at every
    inner AdamW step, beta1 equals torch's OneCycleLR momentum and lr equals torch's
    OneCycleLR LR times the replica's multiplier (one per replica, both present)."""
    mo = section(results, "momentum")
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=W.LR)
    ref = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=W.LR, total_steps=20, cycle_momentum=True)
    for t in range(len(mo[0]["inner"])):
        lr, beta1 = opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0]
        mults = []
        for rank in range(WORLD):
            (group,) = mo[rank]["inner"][t]
            assert group["betas"][0] == pytest.approx(beta1, rel=1e-12), (t + 1, rank)
            assert group["betas"][1] == 0.999
            assert group["lr"] == mo[replica_of(rank) * S]["inner"][t][0]["lr"]
            mults.append(group["lr"] / lr)
        assert sorted(mults[::S]) == pytest.approx(list(MULT), rel=1e-9), (t + 1, mults)
        opt.step()
        ref.step()


# ---- 5. exact resume mid-interval ---------------------------------------------------------

def _diff(a, b) -> float:
    """Largest |a - b| over nested dicts of arrays / floats."""
    if isinstance(a, dict):
        return max([_diff(a[k], b[k]) for k in a] or [0.0])
    if isinstance(a, (list, tuple)):
        return max([_diff(x, y) for x, y in zip(a, b)] or [0.0])
    if isinstance(a, np.ndarray):
        return float(np.abs(a.astype(np.float64) - b).max()) if a.size else 0.0
    if isinstance(a, (int, float)):
        return abs(float(a) - float(b))
    return 0.0 if a == b else math.inf


def _flat(d):
    if isinstance(d, dict):
        for k in sorted(d, key=str):
            yield from _flat(d[k])
    else:
        yield np.asarray(d)


@pytest.mark.parametrize("case", list(W.RESUME_CASES))
def test_resume_mid_interval(results, case):
    """Spread 0.3, OneCycle with cycle_momentum, auto-LR after step 3 (default "log"
    controller, probe fitness), syncs at 3 and 6.
    8 steps uninterrupted vs 4 steps + save + load into a fresh model from other initial
    weights + 4 steps: same LRs at every step, same parameters, buffers, inner optimizer
    state and param groups, scheduler state and last sync record. Bitwise except
    "global" with DDP's bucket rebuild (module docstring)."""
    res = [x[case] for x in section(results, "resume")]
    tag = res[0]["tag"]
    assert tag == f"global_step{W.RESUME_AT}" and all(x["tag"] == tag for x in res)
    assert np.abs(res[0]["B_at_save"]["params"] - res[2]["B_at_save"]["params"]).max() > 1e-5, \
        "replicas equal at the save step: the checkpoint would not prove per-replica state"
    exact = case != "global"
    for rank, r in enumerate(res):
        assert np.abs(r["C_before_load"] - r["B_at_save"]["params"]).max() > 1e-2
        # last_sync is the published record of the last sync, not state: empty until the next one.
        assert not r["C_after_load"]["sched"]["last_sync"] and r["B_at_save"]["sched"]["last_sync"]
        loaded, saved = ({**x, "sched": {k: v for k, v in x["sched"].items() if k != "last_sync"}}
                         for x in (r["C_after_load"], r["B_at_save"]))
        assert same(loaded, saved), f"rank {rank}: load did not restore the saved state"
        for step in range(1, W.RESUME_STEPS + 1):
            second = r["B_lrs"] if step <= W.RESUME_AT else r["C_lrs"]
            if exact:
                assert second[step] == r["A_lrs"][step], f"rank {rank}: LR differs at step {step}"
            else:
                assert second[step] == pytest.approx(r["A_lrs"][step], rel=1e-6), (rank, step)
        A, C = r["A"], r["C"]
        if exact:
            for key in A:
                assert same(C[key], A[key]), f"rank {rank}: {key} differs after resume"
        else:
            for key in ("params", "buffers", "state"):
                for a, c in zip(_flat(A[key]), _flat(C[key]), strict=True):
                    np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-7, err_msg=f"rank {rank}: {key}")
            assert C["sched"]["permutations"] == A["sched"]["permutations"]
            state_a, state_c = ({k: v for k, v in x["sched"].items() if k not in ("last_sync", "sync")}
                                for x in (A, C))
            assert _diff(state_c, state_a) < 1e-9
            # losses (the interval's sum, the last sync's record) and probe fitness: float32
            # losses of weights that differ in the last bits (docstring)
            sync_a, sync_c = A["sched"]["sync"], C["sched"]["sync"]
            assert sync_c["loss_count"] == sync_a["loss_count"]
            assert _diff(sync_c["loss_sum"], sync_a["loss_sum"]) <= 1e-6 * abs(sync_a["loss_sum"])
            last_a, last_c = A["sched"]["last_sync"], C["sched"]["last_sync"]
            assert last_c.keys() == last_a.keys()
            fitness_scale = max(abs(x) for kk, x in last_a.items() if kk.startswith("hdet/fitness/"))
            for k, v in last_a.items():
                scored = k.startswith(("hdet/loss/", "hdet/fitness/"))
                tol = 1e-6 * abs(v) if scored else 1e-9
                if k == "hdet/temperature":
                    # the std of the fitness values: their last-bit differences in absolute
                    # terms (a small gap makes the relative difference larger)
                    tol = 1e-6 * fitness_scale
                assert _diff(last_c[k], v) <= tol, f"rank {rank}: {k}"
    state = res[0]["A"]["sched"]  # auto-LR ran at 3 and 6, scored by the probe
    assert state["updates"] == 2 and state["log_m"][str(("lr", 0))] != 0
    assert "hdet/fitness/replica_1" in state["last_sync"]


def test_checkpoint_layout(results):
    """Rank (r, s) writes replica_r/<tag>/{oss_shard_s, hdet_shard_s}.pt, shard rank 0
    also replica_r/<tag>/model.pt; rank 0 the layout file and ``latest``; no file is
    written twice. A 4 x 1 layout refuses the checkpoint before any collective."""
    _, root = results
    res = section(results, "resume")
    for case in W.RESUME_CASES:
        tag = res[0][case]["tag"]
        written = rank_tools.assert_single_writers(os.path.join(root, case), [x[case]["written"] for x in res])
        for rank in range(WORLD):
            r, s = replica_of(rank), rank % S
            mine = {f"replica_{r}/{tag}/oss_shard_{s}.pt", f"replica_{r}/{tag}/hdet_shard_{s}.pt"}
            if s == 0:
                mine.add(f"replica_{r}/{tag}/model.pt")
            assert set(written[rank]) == mine, f"{case} rank {rank}: {sorted(written[rank])}"
    rank_tools.assert_layout_refused([x["layout_error"] for x in res])


# ---- 6. refused models and configs --------------------------------------------------------

EXPECTED_ERRORS = {
    "fsdp": ["the model itself", "fairscale.nn.FullyShardedDataParallel", "KeyError: 'all_gather'",
             "hdet_scale.backends.fsdp2.initialize", "backend: fsdp2"],
    "nested_fsdp": ["module 'fc2'", "fairscale.nn.FullyShardedDataParallel", "hdet_scale.backends.fsdp2"],
    "sharded_ddp": ["fairscale.nn.ShardedDataParallel", "unwrapped model"],
    "torch_ddp": ["DistributedDataParallel", "unwrapped module"],
    "spread_ratio": ["hdet.axes.lr.spread_ratio"],
    "replicas": ["hdet.replicas"],
    "unknown_key": ["hdet.sync_intervall: unknown key"],
    "gradient_sharing": ["hdet.gradient_sharing"],
    "ddp_process_group": ["ddp_kwargs['process_group']"],
}


def test_refused_models_and_configs_fail_on_every_rank(results):
    """fairscale's FSDP really fails here (its forward raises KeyError: 'all_gather' on
    the gloo group); initialize refuses it (also nested), ShardedDDP, a DDP-wrapped model,
    bad hdet configs and group arguments it owns, with HDETConfigError on every rank, by
    itself: no collective runs (forbidden in the worker), so no rank can wait on another."""
    errs = section(results, "errors")
    assert set(W.ERROR_CASES) == set(EXPECTED_ERRORS)
    for rank, x in enumerate(errs):
        assert x["forward_error"].startswith("KeyError: 'all_gather'"), f"rank {rank}: {x['forward_error']}"
        for case, needles in EXPECTED_ERRORS.items():
            text = x["cases"][case]
            assert text.startswith("HDETConfigError"), f"rank {rank} {case}: {text}"
            for needle in needles:
                assert needle in text, f"rank {rank} {case}: {needle!r} not in {text}"
            assert text == errs[0]["cases"][case]
            assert x["seconds"][case] < 1.0
