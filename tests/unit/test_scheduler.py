"""Unit tests for hdet_scale.ensemble.HDETScheduler driven in one process.

``LocalSync`` below is a small in-process implementation of the scheduler's ``Sync``
protocol for R replicas held by this process: ``add_loss`` takes the R per-replica losses
of one step, ``interval_losses`` returns their per-replica means since the last call.
``converge`` only records what it was asked (there are no weights to average here).
``probe_losses(probe)`` returns ``probe()``, a list of R fitness values (the test's stand-in
for the replicas' probe losses), and records the call.

The auto-LR tests here check the paper's update (``PAPER``: controller "paper", fitness
"train_loss", groups "independent"); the log controller is tested in test_autolr.py.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from hdet_scale.config import HDETConfig
from hdet_scale.ensemble import HDETScheduler
from hdet_scale.errors import HDETConfigError, HDETStateError
from hdet_scale.schedules import OneCycle

A = 1.0 / 9.0

# These short "paper" runs are the case hdet_scale.autolr.drowning_warning is about (decay
# per sync above step_size * spread_ratio); test_autolr.py tests the warning itself.
pytestmark = pytest.mark.filterwarnings("ignore:hdet.auto. the derived decay:UserWarning")


class LocalSync:
    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.local_replicas = list(range(replicas))
        self._sum = [0.0] * replicas
        self._count = [0] * replicas
        self.converge_calls: list[list[bool]] = []
        self.probe_calls = 0

    def probe_losses(self, probe) -> list[float]:
        self.probe_calls += 1
        out = [float(x) for x in probe()]
        assert len(out) == self.replicas
        return out

    def add_loss(self, loss) -> None:
        assert len(loss) == self.replicas
        for r, x in enumerate(loss):
            self._sum[r] += float(x)
            self._count[r] += 1

    def interval_losses(self, step: int | None = None) -> tuple[list[float], list[int]]:
        losses = [s / c if c else float("nan") for s, c in zip(self._sum, self._count)]
        counts = list(self._count)
        self._sum = [0.0] * self.replicas
        self._count = [0] * self.replicas
        return losses, counts

    def converge(self, finite: list[bool]) -> None:
        self.converge_calls.append(list(finite))

    def state_dict(self) -> dict:
        return {"sum": list(self._sum), "count": list(self._count)}

    def load_state_dict(self, state: dict) -> None:
        self._sum = list(state["sum"])
        self._count = list(state["count"])


def make_config(replicas=2, sync_interval=5, total_steps=60, spread=A, wd_spread=None, auto=None,
                seed=0, max_lr=None, **sched) -> HDETConfig:
    axes = {"lr": {"spread_ratio": spread}}
    if wd_spread is not None:
        axes["weight_decay"] = {"spread_ratio": wd_spread}
    block = {"replicas": replicas, "sync_interval": sync_interval, "seed": seed, "axes": axes,
             "schedule": {"name": "onecycle", "total_steps": total_steps, "max_lr": max_lr, **sched}}
    if auto is not None:
        block["auto"] = auto
    return HDETConfig.from_dict(block)


def make_groups(replicas, lrs=(0.1, 0.02), wds=(0.01, 0.0)):
    return {r: [{"lr": lr, "weight_decay": wd} for lr, wd in zip(lrs, wds)] for r in range(replicas)}


def make(cfg, groups=None):
    groups = groups if groups is not None else make_groups(cfg.replicas)
    sync = LocalSync(cfg.replicas)
    return HDETScheduler(cfg, groups, sync), groups, sync


def torch_onecycle_lrs(max_lrs, total_steps, **kw):
    """LR per step 0..total_steps per group from torch's OneCycleLR on a real SGD."""
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in max_lrs]
    opt = torch.optim.SGD([{"params": [p], "lr": 1.0} for p in params], lr=1.0, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=list(max_lrs), total_steps=total_steps,
                                                cycle_momentum=False, **kw)
    out = [[g["lr"] for g in opt.param_groups]]
    for _ in range(total_steps):
        opt.step()
        sched.step()
        out.append([g["lr"] for g in opt.param_groups])
    return out


def lrs_of(groups):
    return {r: [g["lr"] for g in gs] for r, gs in groups.items()}


# ---- fan-out ------------------------------------------------------------------------------

def test_replica_lrs_are_onecycle_times_permuted_multipliers():
    T, N = 5, 40
    cfg = make_config(replicas=2, sync_interval=T, total_steps=N, wd_spread=0.5)
    sch, groups, sync = make(cfg)
    peaks = [0.1, 0.02]  # max_lr None: each group's own lr
    ref = torch_onecycle_lrs(peaks, N)
    rho = [1.0 - A, 1.0 + A]  # R = 2 multipliers by hand
    rho_wd = [0.5, 1.5]
    seen_perms = set()
    for step in range(N + 1):
        for g in range(2):
            perm = sch.permutations[("lr", g)]
            assert sorted(perm) == [0, 1]
            seen_perms.add(tuple(perm))
            for r in range(2):
                assert groups[r][g]["lr"] == ref[step][g] * rho[perm[r]], (step, g, r)
            # the two replicas have different LRs, one high and one low
            assert {groups[0][g]["lr"], groups[1][g]["lr"]} == {ref[step][g] * rho[0], ref[step][g] * rho[1]}
            wperm = sch.permutations[("weight_decay", g)]
            wd0 = (0.01, 0.0)[g]
            for r in range(2):
                assert groups[r][g]["weight_decay"] == wd0 * rho_wd[wperm[r]]
        assert sch.get_last_lr() == [groups[0][0]["lr"], groups[0][1]["lr"]]
        if step < N:
            sch.step([2.0, 2.0])
    assert len(sync.converge_calls) == N // T
    assert all(c == [True, True] for c in sync.converge_calls)
    assert seen_perms == {(0, 1), (1, 0)}  # both assignments occur over 8 syncs


def test_permutations_change_only_at_syncs():
    T = 4
    cfg = make_config(replicas=4, sync_interval=T, total_steps=40, wd_spread=0.3)
    sch, _, _ = make(cfg)
    prev = copy.deepcopy(sch.permutations)
    changed_at = []
    for step in range(1, 41):
        sch.step([1.0] * 4)
        if sch.permutations != prev:
            changed_at.append(step)
        prev = copy.deepcopy(sch.permutations)
    assert changed_at and all(s % T == 0 for s in changed_at)


def test_spread_zero_auto_off_equals_torch_onecycle_everywhere():
    N = 37
    kw = dict(pct_start=0.25, anneal_strategy="linear", div_factor=10.0, final_div_factor=300.0,
              three_phase=True)
    cfg = make_config(replicas=4, sync_interval=6, total_steps=N, spread=0.0, **kw)
    sch, groups, sync = make(cfg, make_groups(4, lrs=(0.3, 1e-3), wds=(0.1, 0.1)))
    ref = torch_onecycle_lrs([0.3, 1e-3], N, **kw)
    for step in range(N + 1):
        for r in range(4):
            assert [g["lr"] for g in groups[r]] == ref[step], (step, r)
            assert [g["weight_decay"] for g in groups[r]] == [0.1, 0.1]
        if step < N:
            sch.step([3.0, 2.0, 1.0, 0.5])
    assert not sch.auto_active


def test_explicit_max_lr_and_cycle_momentum_match_torch_adam():
    N = 30
    cfg = make_config(replicas=2, sync_interval=7, total_steps=N, spread=0.0, max_lr=[0.5, 0.05],
                      cycle_momentum=True, base_momentum=0.8, max_momentum=0.9)
    groups = {r: [{"lr": 1e-3, "weight_decay": 0.0, "betas": (0.9, 0.999)} for _ in range(2)] for r in range(2)}
    sch, groups, _ = make(cfg, groups)
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    opt = torch.optim.Adam([{"params": [p]} for p in params], lr=1e-3)
    ts = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.5, 0.05], total_steps=N, cycle_momentum=True,
                                             base_momentum=0.8, max_momentum=0.9)
    for step in range(N + 1):
        for r in range(2):
            assert [g["lr"] for g in groups[r]] == [g["lr"] for g in opt.param_groups]
            assert [g["betas"] for g in groups[r]] == [g["betas"] for g in opt.param_groups]
        if step < N:
            opt.step()
            ts.step()
            sch.step([1.0, 1.0])


# ---- permutations and RNG -----------------------------------------------------------------

def _perm_history(seed, disturb_global_rng: bool, steps=60):
    cfg = make_config(replicas=4, sync_interval=3, total_steps=steps, seed=seed, wd_spread=0.2)
    if disturb_global_rng:
        torch.manual_seed(999)
    sch, _, _ = make(cfg)
    hist = [copy.deepcopy(sch.permutations)]
    for _ in range(steps):
        if disturb_global_rng:
            torch.rand(13)
            torch.randperm(4)
        sch.step([1.0, 1.1, 1.2, 1.3])
        hist.append(copy.deepcopy(sch.permutations))
    return hist


def test_permutations_reproducible_from_seed_and_independent_of_global_rng():
    h1 = _perm_history(seed=11, disturb_global_rng=False)
    h2 = _perm_history(seed=11, disturb_global_rng=True)
    assert h1 == h2
    assert _perm_history(seed=12, disturb_global_rng=False) != h1
    for perms in h1:
        for p in perms.values():
            assert sorted(p) == [0, 1, 2, 3]
    # the four (axis, group) pairs are not all given the same permutation (independent draws)
    assert any(len({tuple(p) for p in perms.values()}) > 1 for perms in h1)
    # and the permutations actually vary from sync to sync
    assert len({tuple(perms[("lr", 0)]) for perms in h1}) > 3


@pytest.mark.parametrize("auto", [
    {"enabled": True, "warmup_steps": 4, "temperature": 0.1, "controller": "paper", "fitness": "train_loss",
     "groups": "independent"},
    {"enabled": True, "warmup_steps": 4},  # the defaults: log controller, probe fitness, tied groups
], ids=["paper", "log-probe"])
def test_scheduler_never_touches_global_rng(auto):
    torch.manual_seed(2024)
    before = torch.random.get_rng_state().clone()
    cfg = make_config(replicas=4, sync_interval=2, total_steps=20, auto=auto)
    sch, _, sync = make(cfg)
    sch.set_probe(lambda: [1.0, 1.2, 0.9, 1.1])
    for t in range(20):
        sch.step([1.0 + 0.01 * t, 1.1, 1.2, 0.9])
    # meta-updates at the syncs 4, 6, ..., 20 (warm-up 4): 9 probes, none for train_loss fitness
    assert sync.probe_calls == (9 if auto.get("fitness") is None else 0)
    sd = sch.state_dict()
    sch2, _, _ = make(cfg)
    sch2.load_state_dict(sd)
    assert torch.equal(before, torch.random.get_rng_state())


# ---- auto-LR ------------------------------------------------------------------------------

# The paper's update, fitness and per-group exploration, set explicitly (the defaults are
# the log controller with probe fitness and tied groups).
PAPER = {"controller": "paper", "fitness": "train_loss", "groups": "independent"}
AUTO = {"enabled": True, "warmup_steps": 12, "temperature": 0.1, "momentum": 0.9, "step_size": 0.5, **PAPER}


def _loss_for(groups, r, g, t):
    """Loss of replica r at step t: the replica with the higher LR of group g does better."""
    other = 1 - r
    high = groups[r][g]["lr"] > groups[other][g]["lr"]
    return 2.0 - 0.002 * t + (-0.03 if high else 0.03) + 0.001 * r


def test_auto_lr_first_meta_update_by_hand_and_piecewise_constant():
    T, N = 5, 60
    cfg = make_config(replicas=2, sync_interval=T, total_steps=N, auto=AUTO)
    sch, groups, sync = make(cfg)
    peaks = [0.1, 0.02]
    oc = OneCycle(total_steps=N)
    first = 15  # first multiple of T >= W
    K = (N - first) // T + 1  # syncs at 15, 20, ..., 60
    assert K == 10
    bases = []
    interval: list[list[float]] = []
    perm_before_first = None
    for t in range(N):
        losses = [_loss_for(groups, r, 0, t) for r in range(2)]
        if t + 1 == first:
            perm_before_first = {k: list(v) for k, v in sch.permutations.items()}
        interval.append(losses)
        sch.step(losses)
        step = t + 1
        bases.append([sch.base_value("lr", g) for g in range(2)])
        if step < first:
            # warm-up: plain schedule, no meta-update yet
            assert not sch.auto_active
            assert bases[-1] == [oc.value(step, p) for p in peaks]
        if step == first:
            assert sch.auto_active
            L = [sum(x[r] for x in interval[-T:]) / T for r in range(2)]
            mean = (L[0] + L[1]) / 2
            e = [math.exp((mean - L[r]) / 0.1) for r in range(2)]
            w = [x / sum(e) for x in e]
            for g in range(2):
                start = oc.value(first, peaks[g])
                floor = peaks[g] / 25.0 / 1e4
                gamma = 1 - (floor / start) ** (1 / K)
                rho = [1 - A, 1 + A]
                # Delta uses the values the interval's last step (step first - 1) ran with
                vals = [oc.value(first - 1, peaks[g]) * rho[perm_before_first[("lr", g)][r]] for r in range(2)]
                delta = w[0] * vals[0] + w[1] * vals[1] - (vals[0] + vals[1]) / 2
                # the losses favour the replica with the higher LR of group 0: Delta > 0 for
                # group 0, and for group 1 when its permutation is the same
                same = perm_before_first[("lr", g)] == perm_before_first[("lr", 0)]
                assert (delta > 0) == same
                v = 0.1 * delta
                want = start * (1 - gamma) + 0.5 * v
                assert sch.base[("lr", g)] == pytest.approx(want, rel=1e-12)
                assert sch.velocity[("lr", g)] == pytest.approx(v, rel=1e-12)
                assert sch.decay[("lr", g)] == pytest.approx(gamma, rel=1e-12)
                assert sch.last_sync[f"hdet/lr/group_{g}/hypergradient"] == pytest.approx(delta, rel=1e-12)
            assert sch.last_sync["hdet/weight/replica_0"] == pytest.approx(w[0], rel=1e-12)
        if step >= first:
            # replica LRs are the (constant) base times the multipliers
            for g in range(2):
                perm = sch.permutations[("lr", g)]
                b = sch.base[("lr", g)]
                assert [groups[r][g]["lr"] for r in range(2)] == [b * [1 - A, 1 + A][perm[r]] for r in range(2)]
    # after the first meta-update the base changes only at syncs
    for i in range(first, N):  # bases[i] is after step i + 1
        step = i + 1
        if step % T != 0:
            assert bases[i] == bases[i - 1], step
        else:
            assert bases[i] != bases[i - 1], step
    assert all(math.isfinite(b) and b > 0 for row in bases for b in row)


def test_auto_lr_decay_alone_reaches_schedule_floor():
    """Equal losses -> Delta ~ 0: the derived decay alone brings the base to the floor at
    the last sync (the step total_steps)."""
    T, N = 5, 60
    cfg = make_config(replicas=2, sync_interval=T, total_steps=N, auto=dict(AUTO, warmup_steps=10))
    sch, groups, _ = make(cfg)
    oc = OneCycle(total_steps=N)
    for _ in range(N):
        sch.step([1.5, 1.5])
    for g, peak in enumerate([0.1, 0.02]):
        assert sch.base[("lr", g)] == pytest.approx(oc.floor(peak), rel=1e-9)
        assert abs(sch.velocity[("lr", g)]) < 1e-18


def test_auto_lr_explicit_decay_by_hand():
    T, N = 4, 20
    cfg = make_config(replicas=2, sync_interval=T, total_steps=N, spread=0.0,
                      auto=dict(AUTO, warmup_steps=0, decay=0.25))
    sch, _, _ = make(cfg)
    oc = OneCycle(total_steps=N)
    for _ in range(N):
        sch.step([1.0, 1.0])
    # spread 0 -> Delta = 0 exactly-ish; base = value(4) * 0.75 ** 5
    for g, peak in enumerate([0.1, 0.02]):
        assert sch.decay[("lr", g)] == 0.25
        assert sch.base[("lr", g)] == pytest.approx(oc.value(4, peak) * 0.75 ** 5, rel=1e-12)


def test_auto_lr_high_replica_worse_moves_base_below_pure_decay():
    T, N = 5, 30
    cfg = make_config(replicas=2, sync_interval=T, total_steps=N, auto=dict(AUTO, warmup_steps=5, decay=0.0))
    sch, groups, _ = make(cfg)
    start = OneCycle(total_steps=N).value(5, 0.1)
    for t in range(5):
        sch.step([4.0 - _loss_for(groups, r, 0, t) for r in range(2)])  # high LR -> higher loss
    assert sch.velocity[("lr", 0)] < 0
    assert sch.base[("lr", 0)] < start


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_loss_on_one_replica_never_poisons_base(bad):
    T, N = 5, 60
    cfg = make_config(replicas=2, sync_interval=T, total_steps=N, auto=dict(AUTO, warmup_steps=5))
    sch, groups, sync = make(cfg)
    for t in range(N):
        losses = [1.0, 1.0 + 0.01 * t]
        if t >= 12:
            losses[1] = bad  # replica 1 diverges
        sch.step(losses)
        for r in range(2):
            for g in range(2):
                assert math.isfinite(groups[r][g]["lr"]) and groups[r][g]["lr"] > 0
        assert all(math.isfinite(v) for v in sch.base.values())
        assert all(math.isfinite(v) for v in sch.velocity.values())
    # converge was told which replica is finite: syncs at 5 and 10 clean, later ones not
    assert sync.converge_calls[:2] == [[True, True], [True, True]]
    assert all(c == [True, False] for c in sync.converge_calls[2:])
    assert sch.last_sync["hdet/nonfinite_replicas"] == [1]
    assert sch.last_sync["hdet/weight/replica_1"] == 0.0
    assert sch.last_sync["hdet/weight/replica_0"] == 1.0


def test_all_nonfinite_losses_leave_only_decay():
    T, N = 5, 20
    cfg = make_config(replicas=2, sync_interval=T, total_steps=N, auto=dict(AUTO, warmup_steps=5, decay=0.1))
    sch, _, _ = make(cfg)
    start = OneCycle(total_steps=N).value(5, 0.1)
    for _ in range(5):
        sch.step([float("nan"), float("inf")])
    assert sch.base[("lr", 0)] == pytest.approx(start * 0.9, rel=1e-15)
    assert sch.velocity[("lr", 0)] == 0.0


def test_auto_lr_without_loss_raises_clear_error():
    cfg = make_config(replicas=2, sync_interval=2, total_steps=10, auto=dict(AUTO, warmup_steps=0))
    sch, _, _ = make(cfg)
    sch.step()
    with pytest.raises(HDETConfigError, match="loss"):
        sch.step()


# ---- state ---------------------------------------------------------------------------------

def _losses(t):
    return [2.0 - 0.01 * t + 0.05 * math.sin(t), 2.0 - 0.012 * t + 0.05 * math.cos(1.3 * t)]


def _run(sch, groups, t0, t1, trace):
    for t in range(t0, t1):
        sch.step(_losses(t))
        trace.append((lrs_of(groups), {r: [g["weight_decay"] for g in gs] for r, gs in groups.items()},
                      dict(sch.base), dict(sch.velocity), copy.deepcopy(sch.permutations)))


@pytest.mark.parametrize("cut", [13, 15])  # mid-interval (pending losses) and right at a sync
def test_state_dict_resume_is_exact(cut):
    T, N = 5, 60
    cfg = make_config(replicas=2, sync_interval=T, total_steps=N, wd_spread=0.4, auto=dict(AUTO, warmup_steps=10))
    ref, ref_groups, _ = make(cfg)
    ref_trace: list = []
    _run(ref, ref_groups, 0, cut + 30, ref_trace)

    a, a_groups, _ = make(cfg)
    _run(a, a_groups, 0, cut, [])
    state = copy.deepcopy(a.state_dict())
    b, b_groups, _ = make(cfg)  # fresh scheduler, fresh groups, fresh sync
    b.load_state_dict(state)
    assert lrs_of(b_groups) == lrs_of(a_groups)
    assert b.step_count == cut
    trace: list = []
    _run(b, b_groups, cut, cut + 30, trace)
    assert trace == ref_trace[cut:]
    assert b.auto_active


def test_load_state_with_different_replicas_raises():
    a, _, _ = make(make_config(replicas=2))
    for _ in range(3):
        a.step([1.0, 1.0])
    b, _, _ = make(make_config(replicas=4))
    with pytest.raises(HDETStateError, match="hdet.replicas"):
        b.load_state_dict(a.state_dict())


def test_load_state_with_different_sync_interval_or_axes_raises():
    a, _, _ = make(make_config(replicas=2, sync_interval=5))
    b, _, _ = make(make_config(replicas=2, sync_interval=6))
    with pytest.raises(HDETStateError, match="hdet.sync_interval"):
        b.load_state_dict(a.state_dict())
    c, _, _ = make(make_config(replicas=2, sync_interval=5, wd_spread=0.1))
    with pytest.raises(HDETStateError):
        c.load_state_dict(a.state_dict())
    bad = a.state_dict()
    bad["version"] = 999
    with pytest.raises(HDETStateError):
        a.load_state_dict(bad)


# ---- set-up errors --------------------------------------------------------------------------

def test_max_lr_list_length_mismatch_raises():
    cfg = make_config(max_lr=[0.1, 0.2, 0.3])
    with pytest.raises(HDETConfigError, match="hdet.schedule.max_lr"):
        make(cfg)


def test_axis_group_out_of_range_raises():
    cfg = HDETConfig.from_dict({"replicas": 2, "axes": {"lr": {"spread_ratio": 0.1, "groups": [5]}},
                                "schedule": {"total_steps": 10}})
    with pytest.raises(HDETConfigError, match="hdet.axes.lr.groups"):
        make(cfg)


def test_unexplored_group_follows_plain_schedule():
    N = 20
    cfg = HDETConfig.from_dict({"replicas": 2, "sync_interval": 4,
                                "axes": {"lr": {"spread_ratio": 0.2, "groups": [1]}},
                                "schedule": {"total_steps": N}})
    sch, groups, _ = make(cfg)
    ref = torch_onecycle_lrs([0.1, 0.02], N)
    for step in range(N + 1):
        assert groups[0][0]["lr"] == groups[1][0]["lr"] == ref[step][0]
        assert sorted([groups[0][1]["lr"], groups[1][1]["lr"]]) == [ref[step][1] * 0.8, ref[step][1] * 1.2]
        if step < N:
            sch.step([1.0, 1.0])


def test_missing_hyperparameter_raises_config_error():
    cfg = make_config(replicas=2, wd_spread=0.1)
    with pytest.raises(HDETConfigError, match="weight_decay"):
        make(cfg, {r: [{"lr": 0.1}, {"lr": 0.2}] for r in range(2)})


def test_a_resume_with_other_hdet_settings_warns_with_each_change():
    """``HDETTrainer`` resuming a checkpoint with another ``axes.lr.spread_ratio`` says
    so (hdet-train lists its changes itself). The scheduler's state keeps the block it
    ran with; a load into a scheduler of other (changeable) settings warns once, naming
    each key old -> new; the same settings say nothing, and the resumed run uses the new
    spread (its LRs differ from the old one's)."""
    import warnings

    from hdet_scale.errors import HDETResumeWarning

    old = make_config(spread=A, seed=0)
    a, _, _ = make(old)
    for t in range(7):
        a.step([1.0 + 0.01 * t, 1.1])
    state = copy.deepcopy(a.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error", HDETResumeWarning)  # the same settings: silent
        same, _, _ = make(old)
        same.load_state_dict(copy.deepcopy(state))
    changed = make_config(spread=0.3, seed=7, total_steps=80).to_dict()
    changed["warm_init"]["enabled"] = True
    new, _, _ = make(HDETConfig.from_dict(changed))
    with pytest.warns(HDETResumeWarning) as caught:
        new.load_state_dict(copy.deepcopy(state))
    assert len(caught) == 1
    text = str(caught[0].message)
    for line in (f"hdet.axes.lr.spread_ratio: {A!r} -> 0.3 (this run's value applies from here on)",
                 "hdet.schedule.total_steps: 60 -> 80 (this run's value applies from here on)",
                 "hdet.seed: 0 -> 7 (the checkpoint's permutation generator is kept)",
                 "hdet.warm_init.enabled: False -> True (no effect on a resumed run)"):
        assert line in text, text
    assert "logging" not in text
    assert new.replica_values("lr", 0) != a.replica_values("lr", 0)  # the same base, the new spread
    # another peak LR (the optimizer's lr) applies too, and is said
    groups = {r: [dict(g, lr=2 * g["lr"]) for g in gs] for r, gs in make_groups(old.replicas).items()}
    peak, _, _ = make(old, groups)
    with pytest.warns(HDETResumeWarning) as caught:
        peak.load_state_dict(copy.deepcopy(state))
    text = str(caught[0].message)
    assert len(caught) == 1 and text.count("peak LR of group") == len(groups[0]), text
    was = make_groups(old.replicas)[0][0]["lr"]
    assert f"peak LR of group 0: {was!r} -> {2 * was!r} (this run's value applies from here on)" in text, text
    # a checkpoint written before the block was kept: nothing to compare, nothing said
    del state["config"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", HDETResumeWarning)
        make(make_config(spread=0.3))[0].load_state_dict(state)


def logged_run(path, every: int = 1, last: int | None = None, steps: int = 20) -> list[dict]:
    """The JSONL records of ``steps`` steps of a 2-replica run (sync every 5 of 20 steps),
    logged every ``every`` steps with ``last_step`` = ``last`` (hdet-train's train.steps)."""
    import json

    from hdet_scale.logging import MetricsLogger

    block = make_config(sync_interval=5, total_steps=20).to_dict()
    block["logging"]["every"] = every
    sch = HDETScheduler(HDETConfig.from_dict(block), make_groups(2), LocalSync(2),
                        logger=MetricsLogger(str(path), append=False))
    if last is not None:
        sch.last_step = last
    for t in range(steps):
        sch.step([1.0 + 0.01 * t, 1.1])
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_last_step_is_recorded_whatever_logging_every(tmp_path):
    """``logging.every=7`` over 20 steps: per-step records (``hdet/loss``) at 7 and 14, and
    at the run's last step 20 (so that steps 15-20 are not without one). hdet-train sets
    ``last_step`` to ``train.steps``; a run of 18 then records 18, not 20. Compared with
    every=1: the last record's values are the same."""
    def per_step(every, last=None, steps=20):
        records = logged_run(tmp_path / f"m{every}_{last}.jsonl", every, last, steps)
        return [r for r in records if "hdet/loss" in r]

    assert [r["step"] for r in per_step(7)] == [7, 14, 20]
    assert [r["step"] for r in per_step(7, last=18, steps=18)] == [7, 14, 18]
    assert per_step(7)[-1] == per_step(1)[-1]


def test_no_base_is_logged_for_a_step_after_the_last(tmp_path):
    """The sync at the last step logs no ``hdet/lr/group_0/base`` for a step that never
    runs (OneCycleLR's formula one step past its end: ~13x the last LR). Every other
    sync logs the next step's base, the mean of the two replicas' LRs that step runs
    with (multipliers 1 -+ 1/9: their mean is the base exactly, up to rounding)."""
    def syncs(last=None, steps=20):
        records = logged_run(tmp_path / f"m{last}.jsonl", 1, last, steps)
        lr_at = {r["step"]: (r["hdet/lr/replica_0/group_0"] + r["hdet/lr/replica_1/group_0"]) / 2
                 for r in records if "hdet/loss" in r}
        return [r for r in records if "hdet/sync" in r], lr_at

    records, lr_at = syncs()
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    assert [r["step"] for r in records if "hdet/lr/group_0/base" in r] == [5, 10, 15]
    for r in records[:3]:
        assert r["hdet/lr/group_0/base"] == pytest.approx(lr_at[r["step"] + 1], rel=1e-12)
    past_end = OneCycle(20).value(20, 0.1)  # what the last sync logged before
    assert past_end > 10 * OneCycle(20).value(19, 0.1)
    # a run that stops early (hdet-train's train.steps) logs the base of the step its resume
    # takes, as the uninterrupted run does (else the resumed metrics would lack it)
    short, _ = syncs(last=15, steps=15)
    assert [r["step"] for r in short if "hdet/lr/group_0/base" in r] == [5, 10, 15]
    assert short[2]["hdet/lr/group_0/base"] == records[2]["hdet/lr/group_0/base"]



def test_the_step_a_stop_names_is_noted_before_its_record_is_written(tmp_path):
    """A SIGTERM between a step's record (written inside the scheduler's step) and the
    trainer's note of that step must not name "step 69" beside a step-70 record: the
    logger hands each record's step to ``on_step`` before writing it, so no record is
    newer than the step a stop line names; the trainer's stopping.note_step gets it."""
    from hdet_scale.logging import MetricsLogger
    from hdet_scale.train import stopping

    path = tmp_path / "metrics.jsonl"
    seen = []

    def on_step(step):
        lines = path.read_text().splitlines() if path.exists() else []
        seen.append((step, len(lines)))
        stopping.note_step(step)

    logger = MetricsLogger(str(path), on_step=on_step)
    for step in (1, 2, 3):
        logger.log({"train/loss": 1.0}, step=step)
        assert stopping.attempt_step() == step == json.loads(path.read_text().splitlines()[-1])["step"]
    logger.log({"summary": 1})  # a record without a step: nothing to note
    logger.close()
    assert seen == [(1, 0), (2, 1), (3, 2)]  # noted before the record was written
