"""HDET on PyTorch FSDP2 across real ranks: 4 gloo ranks on CPU = 2 replicas x 2
shards (ranks 0, 1 = replica 0; ranks 2, 3 = replica 1; ranks s and 2 + s form replica
group s).

Two launches of 4 rank processes (``fsdp2_workers``: a tiny MLP whose Linear(16, 3)
shards unevenly and whose Linear(3, 1) leaves shard 1 with empty weight and bias, a
LayerNorm and a persistent float buffer; AdamW; fixed per-rank batches from seeded
generators). The ranks return numpy data and the assertions run here. A launch costs
~10 s to start on 2 cores, plus ~0.3 s per extra model; so everything but resume runs
in one launch (module-scoped fixture), resume in a second.

Tolerances, stated where used:

- Converge (R = 2) is checked bit for bit: gloo sums the two float32 values of every
  element (one rounding, commutative) and divides by 2 (exact), so numpy's
  ``(a + b) / 2`` in float32 reproduces it exactly.
- The forward after converge vs a plain single-process TinyNet holding the averaged
  weights (cast to bf16 under the bf16 policy): bitwise. FSDP2 computes with the
  all-gathered parameters, i.e. exactly those values, in the same dtypes and the same
  CPU kernels (the reference runs with one thread, as the ranks do). A stale forward
  (pre-converge weights) differs by ~4e-2 here.
- HDET (spread 0, auto-LR off, "global") vs plain FSDP2 over 4 ranks (dp = 4): rtol
  1e-5, atol 1e-6. HSDP averages the same 4 gradients in another order (reduce-scatter
  over 2, then all-reduce over 2, vs one reduce-scatter over 4): last-bit float32
  differences, kept by Adam's normalised update at ~1e-7 relative per step; measured
  max |diff| ~3e-8 after 7 steps at lr 1e-2. Against plain HSDP on the same 2 x 2 mesh
  it is bitwise: the same collectives, and converge of equal replicas is exact.
- "replica" mode vs plain FSDP2 on each replica's 2 ranks: bitwise (same collectives on
  the same groups, no sync within the run).
- Resume: bitwise (same operations on the same data in the same order).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import fsdp2_workers as W
import rank_tools
from rank_tools import REPLICAS, S, WORLD, assert_all_equal, replica_of

LAUNCH_TIMEOUT = 240  # harness deadline: kills every rank and names the stuck ones
# pytest-timeout is only the backstop: it must fire after the harness deadline.
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
ROOT_PARAMS = ["norm.weight", "norm.bias", "head.weight", "head.bias"]  # not in a shard_modules block
launch = functools.partial(rank_tools.launch, timeout=LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def training():
    return launch(W.training_worker)


@pytest.fixture(scope="module")
def resume(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp2_ckpt")
    return root, launch(W.resume_worker, str(root))


def reference_forward(flat: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """TinyNet's output on the probe input with the given full flat parameters, in one
    process and one thread."""
    model = W.build_model()
    with rank_tools.one_thread():
        return rank_tools.reference_forward(model, flat, W.probe_input(), dtype)


# ---- 1, 2 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(W.CONVERGE_CASES))
def test_converge_mean_identity_uneven_and_empty_shards(training, case):
    """Sync at step 3 (inside scheduler.step, after that step's optimizer update): every
    local shard, even (fc1), uneven (fc2: 2 + 1 rows) and empty (head on shard 1), is
    bit-identical on the 2 ranks of its replica group and equals the mean of the two
    replicas' shards captured right before converge; same for the persistent buffer
    (averaged over the replica group, still different inside a shard group, as plain
    FSDP2 leaves it). The mesh follows the gradient mode; every config form is
    accepted."""
    _, sharing, _, _ = W.CONVERGE_CASES[case]
    r = [x["converge"][case] for x in training]
    want_mesh = ["replica", "shard"] if sharing == "global" else ["shard"]
    for x in r:
        assert x["mesh"] == want_mesh, x["mesh"]
        assert x["shares_gradients"] is True  # HDET adds no gradient hook: HSDP shares in "global"
        assert x["param_dtype"] == "torch.float32"  # sharded params stay fp32 under the bf16 policy
        assert x["sync_step"] == 3
        assert [(c["step"], c["finite"]) for c in x["captured"]] == [(3, [True, True])]
    assert r[0]["numels"] == {"fc1.weight": 64, "fc1.bias": 8, "norm.weight": 8, "norm.bias": 8,
                              "fc2.weight": 32, "fc2.bias": 2, "head.weight": 3, "head.bias": 1}
    assert r[1]["numels"] == {"fc1.weight": 64, "fc1.bias": 8, "norm.weight": 8, "norm.bias": 8,
                              "fc2.weight": 16, "fc2.bias": 1, "head.weight": 0, "head.bias": 0}
    for rank in range(WORLD):  # spread 0.5: LR 1e-2 * (1 -+ 0.5), one value per replica
        assert r[rank]["lrs"] == r[replica_of(rank) * S]["lrs"]
    assert sorted([r[0]["lrs"][0][0], r[2]["lrs"][0][0]]) == pytest.approx([0.005, 0.015])

    for s in range(S):
        a, b = r[s]["captured"][0]["local"], r[S + s]["captured"][0]["local"]
        assert np.abs(a - b).max() > 1e-3, f"shard {s}: replicas equal before the sync: test is vacuous"
        expected = (a + b) / np.float32(2)  # exact (module docstring)
        assert expected.dtype == np.float32
        for rank in (s, S + s):
            np.testing.assert_array_equal(r[rank]["post_local"], expected,
                                          err_msg=f"rank {rank}: local shards != replica mean")
        ba, bb = r[s]["captured"][0]["buffers"]["input_mean"], r[S + s]["captured"][0]["buffers"]["input_mean"]
        assert np.abs(ba - bb).max() > 0, "buffer equal before the sync: test is vacuous"
        for rank in (s, S + s):
            np.testing.assert_array_equal(r[rank]["post_buffers"]["input_mean"], (ba + bb) / np.float32(2))
    assert np.abs(r[0]["post_buffers"]["input_mean"] - r[1]["post_buffers"]["input_mean"]).max() > 0
    assert_all_equal([x["post_full"] for x in r], "full parameters after the sync")


@pytest.mark.parametrize("case", sorted(W.CONVERGE_CASES))
def test_forward_after_converge_reads_the_averaged_weights(training, case):
    """The forward right after the sync, and the forward after a hand converge
    (``scheduler.converge()``) that follows a no-grad forward which left unsharded
    copies of the pre-converge weights (the root's under FSDP2's default
    reshard_after_forward, every module's under False), equals a plain forward with the
    averaged fp32 weights (cast to bf16 under the bf16 policy): not stale."""
    bf16, _, reshard, _ = W.CONVERGE_CASES[case]
    dtype = torch.bfloat16 if bf16 else torch.float32
    r = [x["converge"][case] for x in training]
    want_unsharded = {None: ROOT_PARAMS, False: [n for n in r[0]["numels"]], True: []}[reshard]
    for x in r:
        assert x["unsharded_at_converge"] == want_unsharded
    for key, full in (("post_probe", "post_full"), ("post2_probe", "post2_full")):
        probes = [x[key] for x in r]
        assert_all_equal(probes, key)
        np.testing.assert_array_equal(probes[0], reference_forward(r[0][full], dtype),
                                      err_msg=f"{key}: forward does not use the averaged weights")
    for s in range(S):
        expected = (r[s]["pre2_local"] + r[S + s]["pre2_local"]) / np.float32(2)
        for rank in (s, S + s):
            np.testing.assert_array_equal(r[rank]["post2_local"], expected)
    for rank in (0, 2):
        assert np.abs(r[rank]["pre2_probe"] - r[rank]["post2_probe"]).max() > 1e-2, "test is vacuous"


# ---- 3 -------------------------------------------------------------------------------------

def test_spread0_global_equals_plain_fsdp2(training):
    """Spread 0, auto-LR off, "global" (HSDP) on the 2 x 2 mesh follows plain FSDP2 over
    all 4 ranks for 7 steps spanning the syncs at 3 and 6 (tolerance in the module
    docstring), and plain HSDP bit for bit."""
    res = [x["equivalence"] for x in training]
    assert res[0]["global_syncs"] == [0, 0, 1, 1, 1, 2, 2]
    assert all(lr == [W.LR] for lr in res[0]["global_lrs"])
    for t in range(7):
        plain = [x["plain4"][t] for x in res]
        hsdp = [x["plain_hsdp"][t] for x in res]
        hdet = [x["global"][t] for x in res]
        assert_all_equal(plain, f"plain step {t + 1}")
        assert_all_equal(hdet, f"hdet global step {t + 1}")
        np.testing.assert_allclose(hdet[0], plain[0], rtol=1e-5, atol=1e-6,
                                   err_msg=f"hdet (global, spread 0) != plain FSDP2 dp=4 after step {t + 1}")
        np.testing.assert_array_equal(hdet[0], hsdp[0], err_msg=f"hdet != plain HSDP after step {t + 1}")
        for s in range(S):  # spread 0 + shared gradients: the replicas never diverge
            np.testing.assert_array_equal(res[s]["global_local"][t], res[S + s]["global_local"][t])
    assert np.abs(res[0]["global"][-1] - res[0]["global"][0]).max() > 1e-3, "parameters did not move"


def test_global_mode_keeps_optimizer_state_identical_across_replicas(training):
    """Spread 0.5, "global": the replicas' parameters differ between syncs, but HSDP hands
    every replica the same averaged gradient, so Adam's moments and step counters are
    bit-identical on the ranks of each replica group at every step (converge has
    nothing to average there)."""
    res = [x["equivalence"]["spread_global"] for x in training]
    for t in range(4):
        for s in range(S):
            a, b = res[s]["hist"][t], res[S + s]["hist"][t]
            for k in ("exp_avg", "exp_avg_sq", "step"):
                np.testing.assert_array_equal(a["adam"][k], b["adam"][k], err_msg=f"step {t + 1} {k} shard {s}")
            diff = np.abs(a["local"] - b["local"]).max()
            assert (diff == 0) if t + 1 == 3 else (diff > 1e-3), f"step {t + 1}: parameter diff {diff}"


# ---- 4 -------------------------------------------------------------------------------------

def test_replica_mode_keeps_replicas_apart_between_syncs(training):
    """Spread 0, "replica", sync interval longer than the run: each replica group follows
    plain FSDP2 on its own 2 ranks and data bit for bit, the two replicas drift apart,
    and every collective of the 5 training steps ran on the rank's own shard group."""
    res = [x["equivalence"] for x in training]
    assert res[0]["replica_syncs"] == 0
    for rank in range(WORLD):
        for t in range(5):
            np.testing.assert_array_equal(res[rank]["replica"][t], res[rank]["plain2"][t],
                                          err_msg=f"rank {rank} step {t + 1}: != plain FSDP2 on its replica")
        shard_group = tuple(range(replica_of(rank) * S, replica_of(rank) * S + S))
        calls = res[rank]["replica_calls"]
        assert calls and {g for _, g in calls} == {shard_group}, calls
    assert np.abs(res[0]["replica"][0] - res[2]["replica"][0]).max() > 1e-3


def test_replica_mode_converge_leaves_optimizer_state_per_replica(training):
    """Spread 0.5, "replica": Adam moments differ between the replicas, and the step-3
    converge averages parameters only: right after it the parameters are equal while
    each replica keeps the moments it had just before (HDET.md, DESIGN: DiLoCo-style)."""
    res = [x["equivalence"]["spread_replica"] for x in training]
    for s in range(S):
        a, b = res[s], res[S + s]
        assert np.abs(a["hist"][0]["adam"]["exp_avg"] - b["hist"][0]["adam"]["exp_avg"]).max() > 1e-4
        np.testing.assert_array_equal(a["hist"][2]["local"], b["hist"][2]["local"])
        for x in (a, b):
            cap = x["captured"][0]
            assert cap["step"] == 3
            for k in ("exp_avg", "exp_avg_sq", "step"):
                np.testing.assert_array_equal(x["hist"][2]["adam"][k], cap["adam"][k])
        assert np.abs(a["hist"][2]["adam"]["exp_avg"] - b["hist"][2]["adam"]["exp_avg"]).max() > 1e-4
        assert np.abs(a["hist"][3]["local"] - b["hist"][3]["local"]).max() > 1e-4


# ---- 5 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(W.RESUME_CASES))
def test_exact_resume(resume, case):
    """Spread 0.3, auto-LR from the step-3 sync (default "log" controller, probe fitness),
    syncs at 3 and 6. Uninterrupted 8 steps
    vs save at step 5 (mid-interval: the HDET state carries 2 steps of loss) or at
    step 0 + load into a fresh model with other initial weights + the remaining steps:
    the same LR at every step, bit-identical final local shards, full parameters,
    buffers (different on every rank), Adam state, scheduler state and next forward.
    Saving at step 0 leaves the saving run unchanged. Each replica has its own DCP
    folder with one file per shard rank."""
    _, res = resume
    for rank, x in enumerate(res):
        r = x[case]
        at = W.RESUME_CASES[case][3]
        msg = f"[{case}] rank {rank}"
        for step in range(1, W.RESUME_STEPS + 1):
            got = r["B_lrs"][step] if step <= at else r["C_lrs"][step]
            assert got == r["A_lrs"][step], f"{msg}: LR differs at step {step}"
        assert r["C_after_load"]["step"] == at
        assert r["C_after_load"]["loss_count"] == r["B_at_save"]["loss_count"] == at % 3
        assert np.abs(r["C_before_load"] - r["B_at_save"]["local"]).max() > 1e-2
        np.testing.assert_array_equal(r["C_after_load"]["local"], r["B_at_save"]["local"])
        runs = [("C", r["C"])] + ([("B", r["B"])] if "B" in r else [])
        for name, got in runs:
            for k in ("local", "full", "probe"):
                np.testing.assert_array_equal(got[k], r["A"][k], err_msg=f"{msg} {name}: {k}")
            for k in r["A"]["adam"]:
                np.testing.assert_array_equal(got["adam"][k], r["A"]["adam"][k], err_msg=f"{msg} {name}: {k}")
            assert got["buffers"].keys() == r["A"]["buffers"].keys()
            for k in r["A"]["buffers"]:
                np.testing.assert_array_equal(got["buffers"][k], r["A"]["buffers"][k])
            assert got["sched"] == r["A"]["sched"], f"{msg} {name}: scheduler state"
        tag = f"global_step{at}"
        assert r["tag"] == tag
        want = {"hdet_layout.json", "latest"} | {
            f"replica_{q}/{tag}/{f}" for q in range(REPLICAS)
            for f in (".metadata", "__0_0.distcp", "__1_0.distcp", "hdet_shard_0.pt", "hdet_shard_1.pt",
                      "hdet_manifest.json")}
        assert set(r["files"]) == want, r["files"]
    r0 = [x[case] for x in res]
    at = W.RESUME_CASES[case][3]
    if at:
        assert np.abs(r0[0]["B_at_save"]["local"] - r0[2]["B_at_save"]["local"]).max() > 1e-4, \
            "replicas equal at the save step: the checkpoint would not prove per-replica state"
        state = r0[0]["A"]["sched"]  # the default "log" controller ran at 3 and 6, scored by the probe
        assert state["updates"] == 2 and state["log_m"][str(("lr", 0))] != 0, "auto-LR never ran"
        assert "hdet/fitness/replica_1" in state["last_sync"]
        assert np.abs(r0[0]["A"]["buffers"]["input_mean"] - r0[1]["A"]["buffers"]["input_mean"]).max() > 0
    else:
        assert all(x["C_after_load"]["adam"] is None for x in r0), "optimizer state appeared at step 0"


def test_resume_refuses_other_layout_before_any_collective(resume):
    _, res = resume
    rank_tools.assert_layout_refused([x["D_error"] for x in res])


def test_resume_refuses_a_checkpoint_of_another_model_on_every_rank(resume):
    """A model without the head loading the checkpoint of the whole TinyNet: one
    HDETStateError on every rank naming the tensors it lacks, and nothing loaded (before:
    DCP loaded the keys the smaller model asked for and the run went on silently)."""
    _, res = resume
    want = "holds another model than the one loading it: 2 in the checkpoint that this run's model lacks " \
           "(head.weight, head.bias)"
    for rank, x in enumerate(res):
        assert x["E_error"] is not None and want in x["E_error"], (rank, x["E_error"])
        assert x["E_unchanged"], rank


# ---- 6 -------------------------------------------------------------------------------------

BAD = {"replicas": "hdet.replicas", "spread_ratio": "hdet.axes.lr.spread_ratio",
       "unknown_key": "hdet.sync_intervall: unknown key", "disabled": "hdet.enabled"}


def test_bad_config_fails_on_every_rank_without_hanging(training):
    """Every bad config raises HDETConfigError naming the key on every rank by itself,
    with torch.distributed not yet initialised (initialize does not start it) and after
    a launcher script initialised it; a rank waiting in a collective would have tripped
    the harness deadline of the launch."""
    assert set(BAD) == set(W.BAD_CONFIGS)
    for rank, x in enumerate(training):
        bad = x["bad"]
        assert bad["before_init/dist_initialized"] is False
        assert bad["after_init/dist_initialized"] is True
        for phase in ("before_init", "after_init"):
            for case, key in BAD.items():
                text = bad[f"{phase}/{case}"]
                assert text.startswith("HDETConfigError"), f"rank {rank} {phase} {case}: {text}"
                assert key in text, f"rank {rank} {phase} {case}: {text}"
