"""Every backend computes the same HDET as the single-process simulator.

One tiny model, fixed data and seed, R = 2 replicas, spread 0.3, sync every 3 steps,
auto-LR from the second sync, 12 steps (4 syncs, the last one ending the run), in both
gradient modes, run with: ``hdet_scale.Simulator`` (in this process, the oracle), DDP (2
ranks, one replica each), and FSDP2, fairscale OSS and DeepSpeed ZeRO-3 (4 ranks = 2 x 2).
Two process launches in all (``agreement_workers``).

What must agree, and how closely:

- Permutations drawn at every sync: identical (each scheduler draws them from its own
  generator seeded with ``hdet.seed``; losses do not enter).
- Per-replica LRs: bit-identical until the first meta-update (a pure function of the
  step); afterwards rtol 1e-8. The meta-update reads the interval losses, which each
  layout sums in its own order (the simulator: one loss over the replica's 4 samples; a
  2 x 2 world: the mean of two 2-sample losses, then an all-reduce), so they differ in
  the last float32 bits (~1e-7 relative of a loss ~1). The softmax weight (temperature
  0.01) moves by ~1e-7 / 0.01 x w(1 - w) ~ 1e-6 of itself, and enters the base LR only
  through ``lambda * v``, a few % of it here: ~1e-8 at most. Measured: 1.5e-10 (DDP, one
  replica per rank, sums the same samples in the same order: 0, bit-identical).
- Base values at every sync: same tolerance, same reason.
- Parameters after the last converge: atol 2e-6 on parameters of magnitude ~0.1-1.5.
  A replica's gradient is one float32 reduction over 4 samples in the simulator and a
  two-level one (backward over 2 samples, then an all-reduce over the other rank) on
  2 x 2 worlds: last-bit differences (~6e-8 relative) per step, which Adam's normalised
  update passes on at ~lr x 1e-7 and the LR differences above add ~lr x 1e-8; 12 steps
  at lr <= 2.6e-2 plus float32 rounding of the parameters themselves (ulp ~1e-7 at 1):
  a few 1e-7. Measured: 1.6e-7 (FSDP2, fairscale and DeepSpeed alike), 0 for DDP. The
  global and replica modes end 6e-2 apart, so the check has teeth.

DeepSpeed 0.19 clips the gradient norm at 1.0 unless ``gradient_clipping`` is set (its
``GRADIENT_CLIPPING_DEFAULT``); the DeepSpeed run sets 0, like the others.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("fairscale")

import agreement_workers as W  # noqa: E402
import rank_tools  # noqa: E402

from hdet_scale import Simulator  # noqa: E402

MODES = ["global", "replica"]
LAUNCH_TIMEOUT = 300
pytestmark = pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 120)
LR_RTOL = 1e-8
PARAM_RTOL, PARAM_ATOL = 0.0, 2e-6


def simulate(mode: str) -> dict:
    sim = Simulator(W.build_model, W.adamw, W.hdet_block(mode))
    lrs = [list(sim.scheduler.applied[("lr", 0)])]
    syncs = []
    for step in range(1, W.STEPS + 1):
        sim.step(lambda model, r: W.loss_of(model, *W.replica_batch(r, step)))
        lrs.append(list(sim.scheduler.applied[("lr", 0)]))
        if step % W.SYNC == 0:
            syncs.append({"step": step,
                          "permutations": {f"{a}/{g}": list(p) for (a, g), p in sim.scheduler.permutations.items()},
                          "base": sim.scheduler.base_value("lr", 0),
                          "applied": list(sim.scheduler.applied[("lr", 0)]),
                          "delta": sim.scheduler.last_sync.get("hdet/lr/group_0/hypergradient", 0.0)})
    params = rank_tools.flat_numpy(sim.models[0].parameters())
    first_meta = min(s["step"] for s in syncs if s["step"] >= W.hdet_block(mode)["auto"]["warmup_steps"])
    return {"lrs": np.array(lrs), "syncs": syncs, "params": params, "first_meta": first_meta}


@pytest.fixture(scope="module")
def runs() -> dict:
    out = dict(zip([("sim", m) for m in MODES], [simulate(m) for m in MODES]))
    launch = functools.partial(rank_tools.launch, timeout=LAUNCH_TIMEOUT, env=rank_tools.DS_ENV)
    for rank_results in (launch(W.launch_sharded, MODES, world=4), launch(W.launch_ddp, MODES, world=2)):
        for key in rank_results[0]:
            out[key] = [r[key] for r in rank_results]
    return out


BACKENDS = ["ddp", "fsdp2", "fairscale", "deepspeed"]
CASES = [(b, m) for m in MODES for b in BACKENDS]
MEASURED: dict = {}


@pytest.mark.parametrize("backend,mode", CASES, ids=[f"{b}-{m}" for b, m in CASES])
def test_permutations_and_base_values_match_the_simulator(runs, backend, mode):
    sim = runs[("sim", mode)]
    for rank in runs[(backend, mode)]:
        assert [s["step"] for s in rank["syncs"]] == [s["step"] for s in sim["syncs"]] == [3, 6, 9, 12]
        for mine, ref in zip(rank["syncs"], sim["syncs"]):
            assert mine["permutations"] == ref["permutations"], (mine["step"], backend)
            assert mine["base"] == pytest.approx(ref["base"], rel=LR_RTOL), (mine["step"], backend)
    # the controller saw a real hypergradient (the weights departed from 1/2)
    assert max(abs(s["delta"]) / s["base"] for s in sim["syncs"]) > 1e-3


@pytest.mark.parametrize("backend,mode", CASES, ids=[f"{b}-{m}" for b, m in CASES])
def test_per_replica_lrs_match_the_simulator_at_every_step(runs, backend, mode):
    sim = runs[("sim", mode)]
    exact_until = sim["first_meta"]  # lrs[t] is the LR for step t + 1
    for rank in runs[(backend, mode)]:
        mine = np.array(rank["lrs"])
        ref = sim["lrs"][:, rank["replica"]]
        assert mine.shape == ref.shape
        np.testing.assert_array_equal(mine[:exact_until], ref[:exact_until])
        np.testing.assert_allclose(mine, ref, rtol=LR_RTOL, atol=0)
        MEASURED.setdefault(("lr", backend, mode), float(np.max(np.abs(mine - ref) / ref)))
    # the two replicas really ran different LRs
    assert np.all(np.abs(sim["lrs"][:, 0] - sim["lrs"][:, 1]) > 0.1 * sim["lrs"][:, 0])


@pytest.mark.parametrize("backend,mode", CASES, ids=[f"{b}-{m}" for b, m in CASES])
def test_parameters_after_the_last_converge_match_the_simulator(runs, backend, mode):
    sim = runs[("sim", mode)]
    ranks = runs[(backend, mode)]
    for rank in ranks:  # converged: every rank holds the same full parameters
        np.testing.assert_array_equal(rank["params"], ranks[0]["params"])
        np.testing.assert_allclose(rank["params"], sim["params"], rtol=PARAM_RTOL, atol=PARAM_ATOL)
    MEASURED[("params", backend, mode)] = float(np.max(np.abs(ranks[0]["params"] - sim["params"])))
    other = runs[("sim", "replica" if mode == "global" else "global")]
    assert np.max(np.abs(other["params"] - sim["params"])) > 100 * PARAM_ATOL  # the modes differ


def test_report_measured_differences(runs):
    """Prints the measured differences (pytest -s) that the tolerances above are set from."""
    for key, value in sorted(MEASURED.items()):
        print(key, f"{value:.3g}")
