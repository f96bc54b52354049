"""Every backend computes the same HDET as the single-process simulator.

One tiny model, fixed data and seed, R = 2 replicas, spread 0.3, sync every 3 steps,
auto-LR from the second sync, 12 steps (4 syncs, the last one ending the run), two
optimizer parameter groups (matrices at LR, vectors at LR / 2), in both gradient modes
and with both auto-LR controllers:

- "paper": the paper's update of the base value, scored by the interval training loss,
  each parameter group explored on its own (``controller: paper, fitness: train_loss,
  groups: independent``, temperature 0.01);
- "log" (the default path): a log-space multiplier of the schedule, scored by the loss on
  fixed probe batches (shard rank s of each replica evaluates slice s of them; the
  simulator's ``probe_fn`` all of them), one multiplier and permutation for both groups
  ("tied"), automatic temperature.

Each is run with ``hdet_scale.Simulator`` (in this process, the oracle), DDP (2 ranks, one
replica each), and FSDP2, fairscale OSS and DeepSpeed ZeRO-3 (4 ranks = 2 x 2). Then warm
noisy initialisation (nu 0.05) on every backend, to the first converge. Two process
launches in all (``agreement_workers``).

What must agree, and how closely (measured values: ``MEASURED``, printed by
``pytest -s``; the numbers below are from torch 2.13 / DeepSpeed 0.19 on CPU):

- Permutations drawn at every sync: identical (each scheduler draws them from its own
  generator seeded with ``hdet.seed``; losses do not enter).
- Per-replica LRs of both groups and base values: bit-identical until the first
  meta-update (a pure function of the step); afterwards ``LR_RTOL``:

  * "paper", rtol 2e-5. The meta-update reads the interval training losses, which each
    layout sums in its own order (the simulator: one loss over the replica's 4 samples;
    a 2 x 2 world: the mean of two 2-sample losses, then an all-reduce) from weights that
    differ in the last float32 bits: the losses differ by dL ~ 1e-7 (measured up to
    2e-7). At temperature 0.01 a softmax weight moves by w(1 - w) dL / 0.01 ~ 2.5e-6, the
    hypergradient Delta = (w_0 - 1/2)(h_0 - h_1) by ~5e-6 of itself. The derived decay
    cuts the base by 81 % per sync here (the "drowning" regime the controller warns
    about), so after two syncs the base is mostly ``lambda * v`` and carries Delta's
    relative error: a few 1e-6. Measured: 3.9e-6 in "global" mode (FSDP2, DeepSpeed;
    fairscale 1.3e-6), 3e-14 in "replica" mode, 0 for DDP.
  * "log", rtol 1e-12. With R = 2 the automatic temperature (the fitness standard
    deviation) turns the scores into z-scores of +-1, so the weights, hence the
    multiplier, depend on the sign of the fitness gap alone; the layouts' fitness
    differences (< 2e-7 relative, below) only perturb the float64 rounding of the
    z-scores, by ~1e-16 x fitness / gap < 1e-12. The gap is checked to be > 10 x the
    fitness tolerance at every meta-update (it is >= 9.4e-5 relative, ~500 x the
    measured fitness differences), so its sign cannot flip. Measured: 0 everywhere.

- "tied": every replica's LR ratio between the two groups is the peaks' ratio (2) at
  every step, rtol 1e-12 (OneCycle is linear in the peak and both groups get the same
  multiplier and spread; float64 rounding only). The "paper" runs' ratio departs from it
  by > 10 % (independent groups), so the check has teeth.
- Probe fitness (``hdet/fitness/replica_<r>``) at every meta-update: equal on all ranks
  (one all-reduce), and rtol ``FITNESS_RTOL`` = 2e-6 from the simulator's. A probe loss
  (~0.8) is a float32 forward over 8 rows (simulator, DDP) or 4 (2 x 2) with weights
  that differ from the simulator's by <= ~1.2e-7 (the parameter differences below): the
  loss, of gradient O(1) in the weights, moves by a few 1e-7 relative, plus float32
  summation order (~1e-7). Measured: 1.6e-7 for the fitness, 2.3e-7 for a rank's own
  slice loss against the simulator's loss of that replica on that slice (0 for DDP).
  The replica's fitness is the mean of its ranks' slice losses (float64 arithmetic on
  float32 values: rel 1e-12), and the probe does not run before the first meta-update
  nor at all under the "paper" runs' training-loss fitness.
- Parameters after the last converge: atol 2e-6 on parameters of magnitude ~0.1-1.5.
  A replica's gradient is one float32 reduction over 4 samples in the simulator and a
  two-level one (backward over 2 samples, then an all-reduce over the other rank) on
  2 x 2 worlds: last-bit differences (~6e-8 relative) per step, which Adam's normalised
  update passes on at ~lr x 1e-7 and the LR differences above add ~lr x 1e-6 x 1e-2;
  12 steps at lr <= 2.6e-2 plus float32 rounding of the parameters themselves (ulp
  ~1e-7 at 1): a few 1e-7. Measured: 1.2e-7 (FSDP2, fairscale and DeepSpeed alike), 0
  for DDP. The global and replica modes end > 100 x atol apart, so the check has teeth.
- Warm init, DDP (S = 1, the simulator's draws): bit-identical weights after initialize
  and after every step up to the first converge (the same generator seed, the same
  tensors in the same order, the same float64 RMS). Measured: 0.
- Warm init, 2 x 2 (each shard draws its own noise: the same distribution, other
  numbers), nu = 0.05: the noise n_r = theta_r - theta_0 of each replica and the
  replicas' difference are i.i.d. N(0, nu^2 RMS^2) and N(0, 2 nu^2 RMS^2), RMS over the
  whole model before noise (d = 499 elements). Their root mean square over that std is
  chi-distributed, 1 +- 1/sqrt(2d) = 1 +- 0.032: ``WARM_RTOL`` = 0.16 = 5 sigma (a false
  failure has probability < 1e-6; the seeds are fixed, so the outcome is deterministic
  anyway). Measured: at most 0.038 off. The noise (std 0.016) is 1e5 x the float32
  resolution of the weights, so rounding does not enter. ZeRO-3's partitions carry one
  padding element here (head.bias: 3 over 2 ranks), counted into DeepSpeed's RMS: 0.1 %.
  Draws must not repeat (two shard ranks seeded alike draw the same numbers for
  different parameters): the uncentred correlation of any two stretches of 32
  consecutive noise values, at any offset, stays below 0.9. Under independence
  |r| > 0.9 on 32 pairs has probability 1.0e-12 (r^2 ~ Beta(1/2, 31/2)); over the ~1e5
  (offset, start) pairs of a vector and the 12 vectors checked, < 2e-6. Repeated draws
  would give 1.0 (as fairscale's would without ``OSSBackend.noise_parts``). Measured: 0.73.
- The forward pass right after initialize reads the noisy weights: every rank's output
  on a fixed input equals this process's forward with the rank's full parameters, rtol /
  atol ``FORWARD_TOL`` = 1e-6 (the same float32 operations, at most another summation
  order, on O(1) outputs). Measured: 0. DeepSpeed: the gathered working copy equals the
  fp32 masters bit for bit.

DeepSpeed 0.19 clips the gradient norm at 1.0 unless ``gradient_clipping`` is set (its
``GRADIENT_CLIPPING_DEFAULT``); the DeepSpeed runs set 0, like the others.
"""

from __future__ import annotations

import functools
import math

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
LR_RTOL = {"paper": 2e-5, "log": 1e-12}
RATIO_RTOL = 1e-12
PARAM_RTOL, PARAM_ATOL = 0.0, 2e-6
FITNESS_RTOL = 2e-6
MEAN_RTOL = 1e-12
FORWARD_TOL = 1e-6
ROUND_TRIP_ATOL = 3e-7
WARM_RTOL = 0.16
NOISE_CORR_MAX, NOISE_CORR_WINDOW = 0.9, 32


def simulate(controller: str, mode: str, warm: bool = False, steps: int = W.STEPS) -> dict:
    """The oracle run; the same record as a rank's, for every replica at once."""
    slices = [W.probe_slice(s, W.SHARDS) for s in range(W.SHARDS)]
    everything = W.probe_slice(0, 1)
    slice_losses: dict = {}

    def probe_fn(model, r):
        # also each slice's loss, to compare with the 2 x 2 ranks' own probe calls
        slice_losses.setdefault(sim.scheduler.step_count, {})[r] = [
            float(rank_tools.probe_loss(model, x, y)) for x, y in slices]
        return rank_tools.probe_loss(model, *everything)

    with rank_tools.one_thread():
        sim = Simulator(W.build_model, W.optimizer_for(controller), W.hdet_block(mode, controller, warm),
                        probe_fn=probe_fn)
        groups = sim.scheduler.num_groups
        init = [rank_tools.flat_numpy(m.parameters()) for m in sim.models]
        lrs = [[list(v) for v in zip(*(sim.scheduler.applied[("lr", g)] for g in range(groups)))]]
        taus = [_sim_taus(sim)]
        syncs, per_step = [], []
        for step in range(1, steps + 1):
            sim.step(lambda model, r: W.loss_of(model, *W.replica_batch(r, step)))
            lrs.append([list(v) for v in zip(*(sim.scheduler.applied[("lr", g)] for g in range(groups)))])
            taus.append(_sim_taus(sim))
            if step % W.SYNC == 0:
                syncs.append({**W.sync_record(sim.scheduler), "slice_losses": slice_losses.get(step)})
            if warm:
                per_step.append([rank_tools.flat_numpy(m.parameters()) for m in sim.models])
        with sim.scheduler.eval_mode():
            x = rank_tools.flat_numpy(sim.models[0].parameters())
    first_meta = min(s["step"] for s in syncs if s["step"] >= W.WARMUP) if steps > W.WARMUP else None
    return {"lrs": np.array(lrs), "syncs": syncs, "params": rank_tools.flat_numpy(sim.models[0].parameters()),
            "init": init, "steps": per_step, "first_meta": first_meta, "taus": taus, "x": x}


def _sim_taus(sim: Simulator) -> list | None:
    """Per replica: (the scheduler's temperature, replica r's module's tau); ``None``
    without the axis."""
    if "temperature" not in sim.config.axes:
        return None
    return [(sim.scheduler.model_value("temperature", r), m.tau) for r, m in enumerate(sim.models)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = {("sim", c, m): simulate(c, m) for c in W.CONTROLLERS for m in MODES}
    out[("sim", "warm", W.WARM_MODE)] = simulate("log", W.WARM_MODE, warm=True, steps=W.SYNC)
    out[("sim", "temperature", "global")] = simulate("temperature", "global")
    out[("sim", "schedulefree", "global")] = simulate("schedulefree", "global")
    root = str(tmp_path_factory.mktemp("agreement_ckpt"))
    launch = functools.partial(rank_tools.launch, timeout=LAUNCH_TIMEOUT, env=rank_tools.DS_ENV)
    for rank_results in (launch(W.launch_sharded, MODES, root, world=4),
                         launch(W.launch_ddp, MODES, root, world=2)):
        for key in rank_results[0]:
            out[key] = [r[key] for r in rank_results]
    return out


BACKENDS = ["ddp", "fsdp2", "fairscale", "deepspeed"]
CASES = [(b, c, m) for c in W.CONTROLLERS for m in MODES for b in BACKENDS]
CASE_IDS = [f"{b}-{c}-{m}" for b, c, m in CASES]
MEASURED: dict = {}


def _measure(key: tuple, value: float) -> None:
    MEASURED[key] = max(MEASURED.get(key, 0.0), float(value))


def _theta0() -> np.ndarray:
    return rank_tools.flat_numpy(W.build_model().parameters())


# ---- the controllers: permutations, base values, LRs, parameters --------------------------

@pytest.mark.parametrize("backend,controller,mode", CASES, ids=CASE_IDS)
def test_permutations_and_base_values_match_the_simulator(runs, backend, controller, mode):
    sim = runs[("sim", controller, mode)]
    for rank in runs[(backend, controller, mode)]:
        assert [s["step"] for s in rank["syncs"]] == [s["step"] for s in sim["syncs"]] == [3, 6, 9, 12]
        for mine, ref in zip(rank["syncs"], sim["syncs"]):
            assert mine["permutations"] == ref["permutations"], (mine["step"], backend)
            assert mine["base"] == pytest.approx(ref["base"], rel=LR_RTOL[controller]), (mine["step"], backend)
            _measure(("base", backend, controller, mode),
                     max(abs(a - b) / b for a, b in zip(mine["base"], ref["base"])))
            if controller == "log" and mine["step"] >= W.WARMUP:
                assert mine["multiplier"] == pytest.approx(ref["multiplier"], rel=LR_RTOL[controller])
    # the controller saw a real hypergradient (the weights departed from 1/2)
    assert max(abs(s["delta"][0]) / (s["base"][0] if controller == "paper" else 1.0) for s in sim["syncs"]) > 1e-3
    if controller == "log":  # ... and moved the multiplier, the same for both groups ("tied")
        last = sim["syncs"][-1]["multiplier"]
        assert abs(last[0] - 1) > 1e-2 and last[0] == last[1]


@pytest.mark.parametrize("backend,controller,mode", CASES, ids=CASE_IDS)
def test_per_replica_lrs_match_the_simulator_at_every_step(runs, backend, controller, mode):
    sim = runs[("sim", controller, mode)]
    exact_until = sim["first_meta"]  # lrs[t] is the LR for step t + 1
    for rank in runs[(backend, controller, mode)]:
        mine = np.array(rank["lrs"])
        ref = sim["lrs"][:, rank["replica"], :]
        assert mine.shape == ref.shape == (W.STEPS + 1, 2)
        np.testing.assert_array_equal(mine[:exact_until], ref[:exact_until])
        np.testing.assert_allclose(mine, ref, rtol=LR_RTOL[controller], atol=0)
        _measure(("lr", backend, controller, mode), np.max(np.abs(mine - ref) / ref))
        if controller == "log":  # "tied": the user's ratio between the groups holds
            np.testing.assert_allclose(mine[:, 0] / mine[:, 1], W.GROUP_LRS[0] / W.GROUP_LRS[1],
                                       rtol=RATIO_RTOL, atol=0)
    # the two replicas really ran different LRs
    assert np.all(np.abs(sim["lrs"][:, 0] - sim["lrs"][:, 1]) > 0.1 * sim["lrs"][:, 0])
    ratio = sim["lrs"][:, :, 0] / sim["lrs"][:, :, 1]
    if controller == "paper":  # "independent": the ratio is not kept, so the check above has teeth
        assert np.max(np.abs(ratio / 2 - 1)) > 0.1


@pytest.mark.parametrize("backend,controller,mode", CASES, ids=CASE_IDS)
def test_parameters_after_the_last_converge_match_the_simulator(runs, backend, controller, mode):
    sim = runs[("sim", controller, mode)]
    ranks = runs[(backend, controller, mode)]
    for rank in ranks:  # converged: every rank holds the same full parameters
        np.testing.assert_array_equal(rank["params"], ranks[0]["params"])
        np.testing.assert_allclose(rank["params"], sim["params"], rtol=PARAM_RTOL, atol=PARAM_ATOL)
    _measure(("params", backend, controller, mode), np.max(np.abs(ranks[0]["params"] - sim["params"])))
    other = runs[("sim", controller, "replica" if mode == "global" else "global")]
    assert np.max(np.abs(other["params"] - sim["params"])) > 100 * PARAM_ATOL  # the modes differ


# ---- a model-side axis: the attention-style temperature of TinyNet ----------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_model_side_temperature_axis_matches_the_simulator(runs, backend):
    """The "temperature" runs ("log" with ``axes.temperature``: spread 0.2, auto on; the
    model's ``hdet_set_temperature`` hook scales a hidden layer by 1 / tau): every rank's
    module runs its replica's tau at every step, equal to the simulator's replica's
    (rtol 1e-12: the same pure function of the step until the first meta-update, then
    of the sign of the fitness gap, as for the "log" LRs above); the temperature's base
    after each sync and the parameters after the last converge match the simulator's
    (rtol 1e-12; atol ``PARAM_ATOL``, as for the LR runs). The two replicas ran
    different temperatures, auto-LR moved the temperature's base, and the run ends > 100
    x atol from the "log" run without the axis, so the checks have teeth.

    Why temperature and not dropout: dropout masks draw from the global RNG, which the
    Simulator advances once for all R replicas in one process (replica 0's masks, then
    replica 1's, ...) while each rank draws from its own, over its own micro-batch (a
    half of the replica's samples on 2 x 2); no seeding makes the two layouts draw the
    same masks for the same samples. The dropout setter is held to the Simulator by
    value (test_train_axes) and checked on the modules (tests/unit/test_model_axes.py)."""
    key = ("temperature", "global")
    sim = runs[("sim", *key)]
    for rank in runs[(backend, *key)]:
        r = rank["replica"]
        assert len(rank["taus"]) == len(sim["taus"]) == W.STEPS + 1
        for step, (mine, ref) in enumerate(zip(rank["taus"], sim["taus"])):
            assert mine[0] == mine[1], f"step {step}: the module runs {mine[1]}, the scheduler says {mine[0]}"
            assert mine[0] == pytest.approx(ref[r][0], rel=1e-12), (step, backend)
            assert ref[r][0] == ref[r][1]  # the simulator's replica r module runs its value too
        for mine, ref in zip(rank["syncs"], sim["syncs"]):
            assert mine["tau_base"] == pytest.approx(ref["tau_base"], rel=1e-12), (mine["step"], backend)
        np.testing.assert_allclose(rank["params"], sim["params"], rtol=PARAM_RTOL, atol=PARAM_ATOL)
        _measure(("params", backend, "temperature"), np.max(np.abs(rank["params"] - sim["params"])))
    assert all(abs(t[0][0] - t[1][0]) > 0.1 for t in sim["taus"][:-1])  # replicas at different temperatures
    # after the last step every replica runs the shared base
    assert sim["taus"][-1][0] == sim["taus"][-1][1]
    assert abs(sim["syncs"][-1]["tau_base"] - 1.0) > 1e-2  # auto moved the base
    assert np.max(np.abs(sim["params"] - runs[("sim", "log", "global")]["params"])) > 100 * PARAM_ATOL


# ---- HDET on top of schedule-free AdamW ---------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_schedule_free_matches_the_simulator_and_resumes_exactly(runs, backend):
    """Schedule-free AdamW (``W.sf_adamw``: its own 2-step warm-up, HDET's schedule
    constant, the "log" controller scored by the probe in eval mode), "global" mode.
    Converge averages the parameters y *and* the optimizer's ``z`` (and its group
    scalars), so after the last converge every rank holds the same y and the same
    evaluation point x (``scheduler.eval_mode()``), and both equal the simulator's.

    Tolerances as for the AdamW "log" runs above: LRs and permutations rtol 1e-12
    (the multiplier depends on the sign of the fitness gap alone with R = 2); y and x
    atol ``PARAM_ATOL`` (float32 summation order of the two-level gradient reduction).
    Teeth: x and y end > 100 x atol apart (an x taken from y alone, or a z left per
    replica, would not match; the unit tests show the replicas' x differ without the z
    average), and auto-LR moved the multiplier.

    The run saved a checkpoint at step ``SAVE_AT`` (between syncs: each replica's y, z
    and group scalars); a fresh initialize that loads it and runs on to the end equals
    the uninterrupted run bit for bit (y, x, LRs; fairscale to ``PARAM_ATOL``, below)."""
    sim = runs[("sim", "schedulefree", "global")]
    ranks = runs[(backend, "schedulefree", "global")]
    resumed = runs[(backend, "schedulefree-resumed", "global")]
    for rank in ranks:
        np.testing.assert_array_equal(rank["params"], ranks[0]["params"])
        np.testing.assert_array_equal(rank["x"], ranks[0]["x"])
        # eval_mode's exit puts y back: two float32 lerps (y -> x -> y), each rounding once,
        # the first error scaled by |1 - beta1| = 0.1 in the second: <= 1.1 ulp of |y| < 2,
        # 2.7e-7. Measured: 1.5e-8.
        np.testing.assert_allclose(rank["y_after_eval"], rank["params"], rtol=0, atol=ROUND_TRIP_ATOL)
        _measure(("sf_round_trip", backend), np.max(np.abs(rank["y_after_eval"] - rank["params"])))
        np.testing.assert_allclose(rank["params"], sim["params"], rtol=0, atol=PARAM_ATOL)
        np.testing.assert_allclose(rank["x"], sim["x"], rtol=0, atol=PARAM_ATOL)
        np.testing.assert_allclose(np.array(rank["lrs"]), sim["lrs"][:, rank["replica"], :], rtol=1e-12, atol=0)
        for mine, ref in zip(rank["syncs"], sim["syncs"]):
            assert mine["permutations"] == ref["permutations"]
    _measure(("sf_params", backend), np.max(np.abs(ranks[0]["params"] - sim["params"])))
    _measure(("sf_x", backend), np.max(np.abs(ranks[0]["x"] - sim["x"])))
    assert np.max(np.abs(sim["x"] - sim["params"])) > 100 * PARAM_ATOL
    assert abs(sim["syncs"][-1]["multiplier"][0] - 1) > 1e-2
    # fairscale: DDP over 4 ranks rebuilds its gradient buckets after a process' first
    # iteration, so the first step after the resume sums the same gradients in another
    # order (backends/fairscale.load_checkpoint): last bits, PARAM_ATOL. Measured: 1.2e-7.
    atol = PARAM_ATOL if backend == "fairscale" else 0.0
    for mine, ref in zip(sorted(resumed, key=lambda r: (r["replica"], r["shard"])),
                         sorted(ranks, key=lambda r: (r["replica"], r["shard"]))):
        np.testing.assert_allclose(mine["params"], ref["params"], rtol=0, atol=atol, err_msg=f"{backend}: resumed y")
        np.testing.assert_allclose(mine["x"], ref["x"], rtol=0, atol=atol, err_msg=f"{backend}: resumed x")
        _measure(("sf_resume", backend), np.max(np.abs(mine["x"] - ref["x"])))
        np.testing.assert_array_equal(np.array(mine["lrs"][-1]), np.array(ref["lrs"][-1]))


def test_schedule_free_on_zero3_sub_groups_matches_the_simulator(runs):
    """ZeRO-3 with ``sub_group_size`` 100 splits each parameter group into sub-groups (this
    model: 499 elements in 2 groups, so 6 sub-groups on each rank) and steps the client
    optimizer once per sub-group; every sub-group takes its group's one step, so the run
    equals the simulator as the one-sub-group run does (atol ``PARAM_ATOL``), and equals
    that run bit for bit."""
    sim = runs[("sim", "schedulefree", "global")]
    split = runs[("deepspeed", "schedulefree-subgroups", "global")]
    whole = runs[("deepspeed", "schedulefree", "global")]
    for mine, ref in zip(split, whole):
        np.testing.assert_allclose(mine["x"], sim["x"], rtol=0, atol=PARAM_ATOL)
        np.testing.assert_array_equal(mine["params"], ref["params"])
        np.testing.assert_array_equal(mine["x"], ref["x"])


# ---- the probe -------------------------------------------------------------------------------

LOG_CASES = [(b, m) for m in MODES for b in BACKENDS]


@pytest.mark.parametrize("backend,mode", LOG_CASES, ids=[f"{b}-{m}" for b, m in LOG_CASES])
def test_probe_fitness_matches_the_simulator(runs, backend, mode):
    """The probe runs on the real ranks at every meta-update (not before): shard rank s of
    each replica on slice s (different rows per shard rank, the same rows in every
    replica), and the fitness every rank logs is the mean of its replica's probe losses
    and equals the simulator's fitness (on all rows)."""
    sim = runs[("sim", "log", mode)]
    ranks = runs[(backend, "log", mode)]
    S = ranks[0]["shard_size"]
    assert S == (1 if backend == "ddp" else W.SHARDS)
    for i, ref in enumerate(sim["syncs"]):
        step = ref["step"]
        mine = [rank["syncs"][i] for rank in ranks]
        if step < W.WARMUP:  # no meta-update: no probe, no fitness
            assert ref["fitness"] == [None, None] and all(m["fitness"] == [None, None] for m in mine)
            assert all(not m["probe_calls"] for m in mine)
            continue
        f_ref = ref["fitness"]
        assert all(math.isfinite(f) for f in f_ref)
        gap = abs(f_ref[0] - f_ref[1])
        assert gap > 10 * FITNESS_RTOL * max(f_ref), "fitness gap near the tolerance: the sign could flip"
        for rank, m in zip(ranks, mine):
            assert m["fitness"] == mine[0]["fitness"], f"step {step}: fitness differs between ranks"
            assert m["fitness"] == pytest.approx(f_ref, rel=FITNESS_RTOL), (step, backend)
            assert m["weights"] == pytest.approx(ref["weights"], rel=FITNESS_RTOL)
            _measure(("fitness", backend, mode), max(abs(a - b) / b for a, b in zip(m["fitness"], f_ref)))
            (call,) = m["probe_calls"]  # one probe call per rank per meta-update
            r, s = rank["replica"], rank["shard"]
            assert call["shard"] == s
            want = ref["slice_losses"][r][s] if S > 1 else f_ref[r]
            assert call["loss"] == pytest.approx(want, rel=FITNESS_RTOL), (step, backend, r, s)
            _measure(("probe_slice_loss", backend, mode), abs(call["loss"] - want) / want)
        for r in range(W.REPLICAS):
            calls = [m["probe_calls"][0] for rank, m in zip(ranks, mine) if rank["replica"] == r]
            assert mine[0]["fitness"][r] == pytest.approx(sum(c["loss"] for c in calls) / S, rel=MEAN_RTOL)
        if S > 1:  # different rows per shard rank, the same rows in both replicas
            by_shard = {(rank["replica"], rank["shard"]): m["probe_calls"][0]["x_sum"] for rank, m in zip(ranks, mine)}
            for s in range(S):
                assert by_shard[(0, s)] == by_shard[(1, s)]
            assert by_shard[(0, 0)] != by_shard[(0, 1)]
            assert ref["slice_losses"][0][0] != pytest.approx(ref["slice_losses"][0][1], rel=1e-3)
    for rank in runs[(backend, "paper", mode)]:  # fitness "train_loss": the probe never runs
        assert all(not s["probe_calls"] and s["fitness"] == [None, None] for s in rank["syncs"])


# ---- warm noisy initialisation ----------------------------------------------------------------

WARM = ("warm", W.WARM_MODE)


def test_warm_init_ddp_matches_the_simulator_exactly(runs):
    """DDP with one rank per replica draws the simulator's noise: the same weights after
    initialize and after every step up to the first converge, bit for bit."""
    sim = runs[("sim", *WARM)]
    ranks = runs[("ddp", *WARM)]
    for rank in ranks:
        r = rank["replica"]
        np.testing.assert_array_equal(rank["init"]["params"], sim["init"][r], err_msg=f"replica {r} after initialize")
        for t, params in enumerate(rank["steps"]):
            np.testing.assert_array_equal(params, sim["steps"][t][r], err_msg=f"replica {r} after step {t + 1}")
        np.testing.assert_array_equal(np.array(rank["lrs"]), sim["lrs"][:, r, :])
    assert np.abs(sim["init"][0] - sim["init"][1]).max() > 1e-3


def _max_window_correlation(noise: np.ndarray, window: int = NOISE_CORR_WINDOW) -> tuple[float, int, int]:
    """Largest |correlation| (uncentred: the noise has mean 0) between two stretches of
    ``window`` consecutive elements of ``noise``, over every start and every offset
    between them: ``(|r|, offset, start)``."""
    best = (0.0, 0, 0)
    kernel = np.ones(window)
    for lag in range(1, noise.size - window + 1):
        a, b = noise[:-lag], noise[lag:]
        ab, aa, bb = (np.convolve(u, kernel, "valid") for u in (a * b, a * a, b * b))
        r = np.abs(ab) / np.sqrt(aa * bb)
        i = int(np.argmax(r))
        if r[i] > best[0]:
            best = (float(r[i]), lag, i)
    return best


def _noise_checks(noise: np.ndarray, std: float, what: str) -> None:
    """``noise`` (float64, module order) looks i.i.d. N(0, std^2): root mean square within
    ``WARM_RTOL`` of std, and no two stretches of it proportional to each other."""
    rms = float(np.sqrt(np.mean(noise ** 2)))
    assert rms == pytest.approx(std, rel=WARM_RTOL), f"{what}: noise rms {rms:.4g} != {std:.4g}"
    _measure(("warm_rms_rel_err",), abs(rms / std - 1))
    corr, lag, start = _max_window_correlation(noise)
    assert corr < NOISE_CORR_MAX, (f"{what}: noise at {start}..{start + NOISE_CORR_WINDOW} and {lag} further on "
                                   f"is correlated ({corr:.6f}): the same draws twice")
    _measure(("warm_max_window_corr",), corr)


@pytest.mark.parametrize("backend", BACKENDS)
def test_warm_init_adds_independent_noise_per_replica(runs, backend):
    """Warm init, nu 0.05, "replica" mode, to the first converge (step 3): (a) the
    replicas differ after initialize by noise of the stated distribution; (b) the ranks
    of one replica hold the same full weights, and their next forward reads them (the
    working copies were refreshed); (c) the step-3 converge leaves every rank identical.
    fairscale's run freezes norm.bias: a parameter outside the OSS buckets, whole on every
    rank of the replica, which must get the same noise on all of them."""
    ranks = runs[(backend, *WARM)]
    theta0 = _theta0().astype(np.float64)
    std = W.NU * float(np.sqrt(np.mean(theta0 ** 2)))
    by_replica = {r: [x for x in ranks if x["replica"] == r] for r in range(W.REPLICAS)}
    model = W.build_model()
    for r, members in by_replica.items():
        init = members[0]["init"]["params"]
        for x in members:  # (b) consistent within the replica
            np.testing.assert_array_equal(x["init"]["params"], init, err_msg=f"replica {r}: ranks disagree")
            ref = rank_tools.reference_forward(model, init, W.forward_input())
            np.testing.assert_allclose(x["init"]["forward"], ref, rtol=FORWARD_TOL, atol=FORWARD_TOL,
                                       err_msg=f"replica {r}: the forward does not read the noisy weights")
            _measure(("warm_forward", backend), np.max(np.abs(x["init"]["forward"] - ref)))
            if "master" in x["init"]:  # DeepSpeed: the working copy is the fp32 masters
                np.testing.assert_array_equal(x["init"]["master"], x["init"]["params"])
        _noise_checks(init.astype(np.float64) - theta0, std, f"{backend} replica {r}")  # (a)
    a, b = (by_replica[r][0]["init"]["params"].astype(np.float64) for r in range(W.REPLICAS))
    _noise_checks(b - a, math.sqrt(2) * std, f"{backend} replica difference")
    # (c) the replicas drift apart until the step-3 converge, which equalises them
    assert [len(x["steps"]) for x in ranks] == [W.SYNC] * len(ranks)
    assert np.abs(by_replica[0][0]["steps"][1] - by_replica[1][0]["steps"][1]).max() > 1e-3
    rank_tools.assert_all_equal([x["steps"][W.SYNC - 1] for x in ranks], f"{backend}: after the first converge")
    rank_tools.assert_all_equal([x["params"] for x in ranks], f"{backend}: at the end")
    if backend == "fairscale":  # its frozen norm.bias (in no OSS bucket) got noise too, differently per replica
        names = [n for n, _ in model.named_parameters()]
        sizes = [p.numel() for p in model.parameters()]
        i = names.index("norm.bias")
        lo, hi = sum(sizes[:i]), sum(sizes[:i + 1])
        assert np.abs(a[lo:hi] - b[lo:hi]).min() > 0 and np.abs(a[lo:hi] - theta0[lo:hi]).min() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_warm_init_leaves_every_rank_on_the_same_weights(runs, backend):
    """(d) Warm init disabled (every controller run): right after initialize every rank of
    every replica holds the model's initial weights, bit for bit."""
    theta0 = _theta0()
    for controller in W.CONTROLLERS:
        for mode in MODES:
            for i, x in enumerate(runs[(backend, controller, mode)]):
                np.testing.assert_array_equal(x["init"]["params"], theta0, err_msg=f"{controller} {mode} rank {i}")


def test_report_measured_differences(runs):
    """Prints the measured differences (pytest -s) that the tolerances above are set from."""
    for key, value in sorted(MEASURED.items()):
        print(key, f"{value:.3g}")
