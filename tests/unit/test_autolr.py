"""Unit tests for the redesigned auto-LR controller: the pure log-space functions of
hdet_scale.controller (auto_temperature, normalized_hypergradient, log_update), the
hdet_scale.autolr helpers (decay_for, drowning_warning) and HDETScheduler driven with the
"log" controller, probe fitness and tied / independent groups.

Expected values are computed by hand in each test (math.exp / math.tanh on Python floats,
permutations redrawn from a fresh ``torch.Generator().manual_seed(seed)``), never by
calling the function under test. Comparisons of float64 arithmetic use rel=1e-12: the
hand computation and the code differ only in the order of a few roundings.

``FitnessSync`` is an in-process stand-in for the scheduler's ``Sync`` protocol (as
``LocalSync`` in test_scheduler.py) whose ``probe_losses(probe)`` returns ``probe()``, a
list of R fitness values chosen by the test.
"""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch

from hdet_scale.autolr import decay_for, drowning_warning
from hdet_scale.config import HDETConfig
from hdet_scale.controller import (Weights, auto_temperature, hypergradient, log_update, normalized_hypergradient,
                                   softmax_weights)
from hdet_scale.ensemble import HDETScheduler, build_schedule
from hdet_scale.errors import HDETConfigError, HDETStateError
from test_scheduler import LocalSync  # noqa: E402  (tests/unit is on sys.path under pytest)
from hdet_scale.schedules import OneCycle

NAN, INF = float("nan"), float("inf")
PAPER = {"controller": "paper", "fitness": "train_loss", "groups": "independent"}


# The scheduler tests' hand-made sync: per-replica loss sums, recorded converges, and
# probe_losses(probe) returning probe() (R fitness values).
FitnessSync = LocalSync


def config(replicas=3, sync_interval=5, total_steps=40, spread=0.2, auto=None, seed=0, axes=None, **sched):
    block = {"replicas": replicas, "sync_interval": sync_interval, "seed": seed,
             "axes": axes if axes is not None else {"lr": {"spread_ratio": spread}},
             "schedule": {"name": "onecycle", "total_steps": total_steps, **sched},
             "auto": {"enabled": True, "warmup_steps": 0, "step_size": 0.5, **(auto or {})}}
    return HDETConfig.from_dict(block)


def make(cfg, lrs=(0.1, 0.02), wds=(0.01, 0.0)):
    groups = {r: [{"lr": lr, "weight_decay": wd} for lr, wd in zip(lrs, wds)] for r in range(cfg.replicas)}
    sync = FitnessSync(cfg.replicas)
    return HDETScheduler(cfg, groups, sync), groups, sync


def offsets(R):
    """Spread offsets by hand: (j - (R-1)/2) / max((R-1)/2, 0.5)."""
    c = (R - 1) / 2
    return [(j - c) / max(c, 0.5) for j in range(R)]


def softmax_by_hand(losses, sigma):
    mean = sum(losses) / len(losses)
    e = [math.exp((mean - x) / sigma) for x in losses]
    return [x / sum(e) for x in e]


def pop_std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


# ---- pure functions -----------------------------------------------------------------------

def test_auto_temperature_is_population_std_of_finite_losses():
    # [1, 2, 4]: mean 7/3, squared deviations 16/9, 1/9, 25/9 -> variance 42/27
    assert auto_temperature([1.0, 2.0, 4.0]) == pytest.approx(math.sqrt(42 / 27), rel=1e-14)
    # non-finite replicas are left out: [1, 3] -> std 1 (population, not sample: not sqrt(2))
    assert auto_temperature([1.0, NAN, 3.0, INF]) == pytest.approx(1.0, rel=1e-14)
    assert auto_temperature([2.5, 2.5, 2.5]) == 0.0
    assert auto_temperature([5.0, NAN]) == 0.0  # fewer than two finite
    assert auto_temperature([]) == 0.0


def test_softmax_temperature_zero_is_uniform_over_finite():
    assert softmax_weights([2.0, 2.0, 2.0], 0.0).weights == [1 / 3] * 3
    w = softmax_weights([1.0, NAN, 7.0, 3.0], 0.0)
    assert w.weights == [1 / 3, 0.0, 1 / 3, 1 / 3] and w.finite == [True, False, True, True]


def test_auto_temperature_makes_weights_scale_free():
    """With sigma = std(L), the scores are z-scores: multiplying every loss gap by 1000
    leaves the weights unchanged (up to rounding)."""
    L = [2.0, 2.1, 1.95, 2.3]
    big = [2.0 + 1000 * (x - 2.0) for x in L]
    w1 = softmax_weights(L, auto_temperature(L)).weights
    w2 = softmax_weights(big, auto_temperature(big)).weights
    assert w1 == pytest.approx(w2, rel=1e-9)
    assert w1 == pytest.approx(softmax_by_hand(L, pop_std(L)), rel=1e-12)


def test_normalized_hypergradient_by_hand_four_replicas():
    off = offsets(4)  # -1, -1/3, 1/3, 1
    assert off == pytest.approx([-1, -1 / 3, 1 / 3, 1], rel=1e-15)
    losses, sigma, perm = [2.0, 2.3, 1.9, 2.2], 0.2, [2, 0, 3, 1]
    w = softmax_by_hand(losses, sigma)
    want = sum(w[r] * off[perm[r]] for r in range(4)) - 0.0  # offsets have mean 0
    got = normalized_hypergradient(softmax_weights(losses, sigma), [off[p] for p in perm])
    assert got == pytest.approx(want, rel=1e-12)
    # all weight on the replica at the largest offset -> +1, on the smallest -> -1
    assert normalized_hypergradient(Weights([0, 0, 0, 1.0], [True] * 4), off) == pytest.approx(1.0, rel=1e-15)
    assert normalized_hypergradient(Weights([1.0, 0, 0, 0], [True] * 4), off) == pytest.approx(-1.0, rel=1e-15)
    # equal weights -> 0
    assert normalized_hypergradient(Weights([0.25] * 4, [True] * 4), off) == pytest.approx(0.0, abs=1e-15)


def test_normalized_hypergradient_nonfinite_replicas():
    off = offsets(3)  # -1, 0, 1
    # the replica at +1 diverged: weights over the other two, its offset stays in the mean (0)
    w = softmax_weights([1.0, 1.2, NAN], 0.1)
    w0 = 1 / (1 + math.exp(-2.0))  # scores +1, -1 over the finite pair
    assert w.weights[2] == 0.0
    g = normalized_hypergradient(w, [off[1], off[0], off[2]])  # replica r sits at offset off[perm[r]]
    assert g == pytest.approx(w0 * 0.0 + (1 - w0) * -1.0 + 0.0 * 1.0 - 0.0, rel=1e-12)
    # no finite replica: no signal
    assert normalized_hypergradient(softmax_weights([NAN, INF, -INF], 0.1), off) == 0.0


@pytest.mark.parametrize("losses", [[2.0, 2.3, 1.9, 2.2], [1.0, NAN, 1.4, 0.8]])
def test_normalized_hypergradient_is_delta_over_alpha_h(losses):
    """For a multiplicative axis the paper's Delta over values h (1 + alpha off_pi(r))
    is h * alpha * g: Delta = sum w h (1 + alpha off) - h = h alpha sum w off (sum w = 1,
    mean off = 0)."""
    h, alpha, perm = 3e-4, 0.15, [3, 1, 0, 2]
    off = offsets(4)
    values = [h * (1 + alpha * off[perm[r]]) for r in range(4)]
    w = softmax_weights(losses, 0.1)
    g = normalized_hypergradient(w, [off[p] for p in perm])
    assert hypergradient(w, values) / (alpha * h) == pytest.approx(g, rel=1e-9)
    assert g == pytest.approx(sum(w.weights[r] * off[perm[r]] for r in range(4)), rel=1e-12)


def test_log_update_momentum_two_steps_by_hand():
    lm, v = 0.0, 0.0
    lm, v = log_update(lm, v, 0.6, momentum=0.5, step_size=0.5, max_factor=100.0)
    assert (lm, v) == pytest.approx((0.15, 0.3), rel=1e-15)  # v = 0.5 * 0.6; lm = 0.5 * 0.3
    lm, v = log_update(lm, v, -1.0, momentum=0.5, step_size=0.5, max_factor=100.0)
    # v = 0.15 - 0.5 = -0.35; lm = 0.15 - 0.175 = -0.025
    assert (lm, v) == pytest.approx((-0.025, -0.35), rel=1e-13)
    # momentum 0: v = g
    assert log_update(0.2, 5.0, 0.4, momentum=0.0, step_size=2.0, max_factor=100.0) == pytest.approx((1.0, 0.4))


def test_log_update_clips_at_log_max_factor():
    bound = math.log(4.0)
    lm, v = log_update(1.3, 0.0, 1.0, momentum=0.0, step_size=0.5, max_factor=4.0)  # 1.8 > log 4 = 1.386
    assert lm == pytest.approx(bound, rel=1e-15) and v == 1.0  # the velocity itself is not clipped
    lm, v = log_update(-1.3, 0.0, -1.0, momentum=0.0, step_size=0.5, max_factor=4.0)
    assert lm == pytest.approx(-bound, rel=1e-15) and v == -1.0
    # inside the bound: not clipped
    assert log_update(1.0, 0.0, 0.5, momentum=0.0, step_size=0.5, max_factor=4.0)[0] == pytest.approx(1.25)
    # max_factor 1: the multiplier cannot move
    assert log_update(0.0, 0.0, 1.0, momentum=0.0, step_size=0.5, max_factor=1.0)[0] == 0.0


# ---- the scheduler with the log controller -----------------------------------------------

def test_log_controller_two_meta_updates_by_hand_and_lr_follows_schedule():
    """R = 3, tied groups, probe fitness with the automatic temperature, defaults momentum
    0.5 and step 0.5: log m after the syncs at steps 5 and 10 by hand, then every replica's
    LR at steps 10..15 is OneCycle(t) * m * (1 + alpha off[perm[r]]) exactly as computed
    here (it moves with the schedule between syncs, not piecewise constant)."""
    R, T, N, alpha, seed = 3, 5, 40, 0.2, 3
    cfg = config(replicas=R, sync_interval=T, total_steps=N, spread=alpha, seed=seed)
    sch, groups, sync = make(cfg)
    fitness = iter([[1.0, 1.3, 2.0], [2.0, 1.1, 1.4], [1.5, 1.5, 1.6]])
    sch.set_probe(lambda: next(fitness))
    off, peaks, oc = offsets(R), [0.1, 0.02], OneCycle(total_steps=N)
    gen = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(R, generator=gen).tolist() for _ in range(3)]  # tied: one draw per sync
    lm = v = 0.0
    hand_m = []
    for k, f in enumerate([[1.0, 1.3, 2.0], [2.0, 1.1, 1.4]]):
        w = softmax_by_hand(f, pop_std(f))
        g = sum(w[r] * off[perms[k][r]] for r in range(R))
        v = 0.5 * v + 0.5 * g
        lm = lm + 0.5 * v
        hand_m.append(math.exp(lm))
    for t in range(15):
        assert sch.permutations == {("lr", 0): perms[t // T], ("lr", 1): perms[t // T]}, t
        m = 1.0 if t < 5 else hand_m[0] if t < 10 else hand_m[1]
        for g in range(2):
            want = [oc.value(t, peaks[g]) * m * (1 + alpha * off[perms[t // T][r]]) for r in range(R)]
            assert [groups[r][g]["lr"] for r in range(R)] == pytest.approx(want, rel=1e-12), (t, g)
        sch.step([5.0, 5.0, 5.0])  # equal training losses: any move comes from the probe
        if sch.step_count == 10:
            assert sch.last_sync["hdet/lr/group_0/multiplier"] == pytest.approx(hand_m[1], rel=1e-12)
            assert sch.last_sync["hdet/lr/group_1/multiplier"] == pytest.approx(hand_m[1], rel=1e-12)
            assert sch.last_sync["hdet/lr/group_0/velocity"] == pytest.approx(v, rel=1e-12)
            assert sch.last_sync["hdet/temperature"] == pytest.approx(pop_std([2.0, 1.1, 1.4]), rel=1e-12)
            assert sch.last_sync["hdet/fitness/replica_1"] == 1.1
            assert sch.controller.log_m == pytest.approx({("lr", 0): lm, ("lr", 1): lm}, rel=1e-12)
    assert sync.probe_calls == 3
    assert hand_m[1] != 1.0 and not sch.base  # the log controller keeps no base values
    # between syncs the LR follows the schedule: different values at steps 11 and 12
    lr = [oc.value(t, 0.1) * hand_m[1] for t in (11, 12)]
    assert lr[0] != pytest.approx(lr[1], rel=1e-6)


@pytest.mark.parametrize("mode", ["up", "hold", "both"])
def test_decay_moves_during_the_schedules_decay_by_hand(mode):
    """R = 2, OneCycle over 40 steps (peak at step 12), a sync every 5: the probe says the
    high-LR replica won at the syncs at 5, 25 and 35 and the low-LR one at the others.
    The multiplier after each sync by hand: a sync whose interval the schedule fell over
    (the LR at its last step below the LR at its first) may only raise it with
    decay_moves "up" (the velocity floored at 0), not move it with "hold", and move it
    either way with "both"; each refused move logs held = 1."""
    R, T, N, seed = 2, 5, 40, 4
    cfg = config(replicas=R, sync_interval=T, total_steps=N, seed=seed, auto={"decay_moves": mode})
    sch, groups, sync = make(cfg)
    gen = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(R, generator=gen).tolist() for _ in range(N // T + 1)]
    high_wins = {5, 25, 35}
    oc, off = OneCycle(total_steps=N), offsets(R)

    def fitness():
        k = sch.step_count // T - 1  # this interval's permutation
        winner = [r for r in range(R) if off[perms[k][r]] == (1.0 if sch.step_count in high_wins else -1.0)][0]
        return [1.0 if r == winner else 2.0 for r in range(R)]

    sch.set_probe(fitness)
    lm = v = 0.0
    held = []
    for k in range(N // T):
        for _ in range(T):
            sch.step([3.0, 3.0])
        end = (k + 1) * T
        sign = 1.0 if end in high_wins else -1.0
        w = softmax_by_hand([1.0, 2.0], pop_std([1.0, 2.0]))  # the winner's weight first
        g = sign * (w[0] * 1.0 + w[1] * -1.0)  # sum_r w_r off_r - mean(off), off = +-1
        new_v = 0.5 * v + 0.5 * g
        new_lm = lm + 0.5 * new_v
        decaying = oc.value(end - 1, 1.0) < oc.value(end - T, 1.0)
        if decaying and mode == "hold":
            held.append(end)
        elif decaying and mode == "up" and new_lm < lm:
            v = max(new_v, 0.0)
            held.append(end)
        else:
            lm, v = new_lm, new_v
        assert sch.controller.log_m[("lr", 0)] == pytest.approx(lm, rel=1e-12, abs=1e-15), (mode, end)
        assert sch.controller.velocity[("lr", 0)] == pytest.approx(v, rel=1e-12, abs=1e-15), (mode, end)
        assert sch.last_sync.get("hdet/lr/group_0/held") == (1 if end in held else None), (mode, end)
    assert held == {"up": [15, 20, 30, 40], "hold": [15, 20, 25, 30, 35, 40], "both": []}[mode]


def test_log_controller_warmup_and_no_probe_during_warmup():
    cfg = config(replicas=2, sync_interval=4, total_steps=20, auto={"warmup_steps": 8})
    sch, groups, sync = make(cfg)
    sch.set_probe(lambda: [1.0, 2.0])
    oc = OneCycle(total_steps=20)
    for _ in range(7):
        sch.step([1.0, 1.0])
    assert sync.probe_calls == 0 and not sch.auto_active
    assert sch.base_value("lr", 0) == oc.value(7, 0.1)
    sch.step([1.0, 1.0])
    assert sync.probe_calls == 1 and sch.auto_active


def test_additive_axis_moves_in_units_of_its_spread_ratio():
    """Additive weight decay with auto on: the shift after one meta-update is
    spread_ratio * step_size * (1 - beta) * g, with g from the weight-decay axis' own
    permutation; doubling spread_ratio doubles the shift (same seed, same draws)."""
    R, T, seed = 2, 4, 5
    shifts = []
    for s in (0.05, 0.1):
        axes = {"lr": {"spread_ratio": 0.2}, "weight_decay": {"spread_ratio": s, "kind": "additive", "auto": True}}
        cfg = config(replicas=R, sync_interval=T, total_steps=20, seed=seed, axes=axes)
        sch, groups, _ = make(cfg, wds=(0.3, 0.2))  # > spread_ratio + |shift|: no replica near 0
        sch.set_probe(lambda: [1.0, 3.0])  # replica 0 better
        gen = torch.Generator().manual_seed(seed)
        perm_lr, perm_wd = (torch.randperm(R, generator=gen).tolist() for _ in range(2))  # sorted axes
        assert sch.permutations[("weight_decay", 0)] == perm_wd and sch.permutations[("lr", 0)] == perm_lr
        for _ in range(T):
            sch.step([1.0, 1.0])
        w0 = 1 / (1 + math.exp(-2.0))  # R = 2, auto temperature: scores +1, -1
        off = [-1.0, 1.0]
        g = w0 * off[perm_wd[0]] + (1 - w0) * off[perm_wd[1]]
        shift = s * 0.5 * 0.5 * g
        assert sch.controller.log_m[("weight_decay", 0)] == pytest.approx(shift, rel=1e-12)
        assert sch.last_sync["hdet/weight_decay/group_0/multiplier"] == pytest.approx(shift, rel=1e-12)
        new_perm = sch.permutations[("weight_decay", 0)]
        for gi, wd0 in enumerate((0.3, 0.2)):
            want = [wd0 + shift + s * off[new_perm[r]] for r in range(R)]
            assert [groups[r][gi]["weight_decay"] for r in range(R)] == pytest.approx(want, rel=1e-12, abs=1e-15)
        shifts.append(shift)
    assert shifts[1] == pytest.approx(2 * shifts[0], rel=1e-12) and shifts[0] != 0


def test_an_additive_spread_below_zero_is_refused_and_the_auto_base_floored():
    """An additive weight-decay spread of 0.5 on a decay of 0 would train one replica at
    -0.5 without a word: the scheduler refuses it at construction, naming the axis, the
    group and the values; at exactly the base it is allowed (the lowest replica at 0).
    The "paper" controller keeps an additive base at least spread_ratio above 0, so a
    meta-update cannot take the lowest replica below 0 either."""
    axes = {"weight_decay": {"spread_ratio": 0.05, "kind": "additive", "auto": True}}
    cfg = config(replicas=2, sync_interval=2, total_steps=20, axes=axes)
    with pytest.raises(HDETConfigError) as e:
        make(cfg, wds=(0.05, 0.01))
    assert ("hdet.axes.weight_decay.spread_ratio: an additive spread of 0.05 takes parameter group 1 from its "
            "weight_decay 0.01 to -0.04") in str(e.value), str(e.value)
    assert "group 0" not in str(e.value)
    sch, groups, _ = make(cfg, wds=(0.05, 0.05))
    sch.set_probe(lambda: [3.0, 1.0] if groups[0][0]["weight_decay"] > groups[1][0]["weight_decay"] else [1.0, 3.0])
    for _ in range(12):  # the lower decay always wins: the base is pushed down, then floored
        sch.step([1.0, 1.0])
        assert min(groups[r][g]["weight_decay"] for r in (0, 1) for g in (0, 1)) >= -1e-12


def test_spread_zero_gives_no_move():
    """No spread, no signal: fitness gaps are ignored, the LR is the plain schedule."""
    cfg = config(replicas=3, sync_interval=2, total_steps=12, spread=0.0)
    sch, groups, _ = make(cfg)
    sch.set_probe(lambda: [1.0, 2.0, 4.0])
    oc = OneCycle(total_steps=12)
    for t in range(12):
        sch.step([1.0, 1.5, 2.0])
        for r in range(3):
            assert [g["lr"] for g in groups[r]] == [oc.value(t + 1, 0.1), oc.value(t + 1, 0.02)]
    assert sch.auto_active and sch.controller.log_m == {("lr", 0): 0.0, ("lr", 1): 0.0}
    assert sch.last_sync["hdet/lr/group_0/hypergradient"] == 0.0
    assert sch.last_sync["hdet/lr/group_0/multiplier"] == 1.0


def test_max_factor_bounds_the_multiplier():
    """A probe that always favours the high-LR replica pushes log m up by at most
    step_size per sync; max_factor 1.5 stops it at exactly 1.5."""
    cfg = config(replicas=2, sync_interval=2, total_steps=40, auto={"max_factor": 1.5, "momentum": 0.0,
                                                                     "step_size": 1.0})
    sch, groups, _ = make(cfg)
    sch.set_probe(lambda: [0.0 if groups[r][0]["lr"] > groups[1 - r][0]["lr"] else 1.0 for r in range(2)])
    for _ in range(40):
        sch.step([1.0, 1.0])
    assert sch.last_sync["hdet/lr/group_0/multiplier"] == pytest.approx(1.5, rel=1e-12)
    # held at the bound: logged as "paper" logs its floor, not without a word
    assert sch.last_sync["hdet/lr/group_0/ceiled"] == 1 and "hdet/lr/group_0/floored" not in sch.last_sync


def test_a_lower_max_factor_on_resume_bounds_the_first_resumed_step():
    """A resume with a lower ``auto.max_factor`` holds the restored multiplier at the new
    bound from the first resumed step, not from the next sync (else 1.5 would be kept for
    up to sync_interval steps under a bound of 1.2). Compared with a resume under the old
    bound: every replica's first resumed LR is that one's times exactly 1.2 / 1.5; an
    unchanged max_factor restores the multiplier exactly (a resume stays bit-equal)."""
    import copy

    auto = {"max_factor": 1.5, "momentum": 0.0, "step_size": 1.0}
    cfg = config(replicas=2, sync_interval=2, total_steps=40, spread=0.2, auto=auto)
    sch, groups, _ = make(cfg)
    sch.set_probe(lambda: [0.0 if groups[r][0]["lr"] > groups[1 - r][0]["lr"] else 1.0 for r in range(2)])
    for _ in range(20):
        sch.step([1.0, 1.0])
    state = copy.deepcopy(sch.state_dict())
    assert math.exp(sch.controller.log_m[("lr", 0)]) == pytest.approx(1.5, rel=1e-12)
    same, sgroups, _ = make(cfg)
    same.load_state_dict(copy.deepcopy(state))
    assert same.controller.log_m == sch.controller.log_m  # exactly as saved
    lower = config(replicas=2, sync_interval=2, total_steps=40, spread=0.2, auto={**auto, "max_factor": 1.2})
    resumed, rgroups, _ = make(lower)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the resume warning names max_factor 1.5 -> 1.2
        resumed.load_state_dict(copy.deepcopy(state))
    for r in range(2):  # the same step, permutation and spread: only the multiplier differs
        assert rgroups[r][0]["lr"] == pytest.approx(sgroups[r][0]["lr"] * 1.2 / 1.5, rel=1e-12), r


# ---- groups: tied / independent ----------------------------------------------------------

@pytest.mark.parametrize("auto", [{}, dict(PAPER, groups="tied")], ids=["log", "paper"])
def test_tied_groups_keep_the_users_lr_ratio_every_step(auto):
    """Peaks 0.1 and 0.02: with tied groups every replica's LR ratio group1/group0 is 0.2
    at every step while auto-LR moves the LRs (one multiplier, one permutation per axis)."""
    R, N = 4, 40
    cfg = config(replicas=R, sync_interval=4, total_steps=N, spread=0.3, auto=auto, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the short paper run's drowning warning
        sch, groups, _ = make(cfg)
    sch.set_probe(lambda: [1.0, 1.4, 0.7, 1.1])
    moved = False
    for t in range(N):
        for r in range(R):
            assert groups[r][1]["lr"] / groups[r][0]["lr"] == pytest.approx(0.2, rel=1e-12), (t, r)
        sch.step([1.0 + 0.1 * math.sin(t + r) for r in range(R)])
        moved |= sch.base_value("lr", 0) != pytest.approx(OneCycle(total_steps=N).value(t + 1, 0.1), rel=1e-9)
    assert moved


def test_independent_groups_break_the_ratio():
    """The same run with independent groups: the two groups' permutations differ at some
    sync (seed 1), so some replica's ratio is not 0.2 (the test above can fail)."""
    R, N = 4, 40
    cfg = config(replicas=R, sync_interval=4, total_steps=N, spread=0.3, auto={"groups": "independent"}, seed=1)
    sch, groups, _ = make(cfg)
    sch.set_probe(lambda: [1.0, 1.4, 0.7, 1.1])
    ratios = set()
    for _ in range(N):
        ratios |= {round(groups[r][1]["lr"] / groups[r][0]["lr"], 9) for r in range(R)}
        sch.step([1.0] * R)
    assert len(ratios) > 1


@pytest.mark.parametrize("seed", [0, 7])
def test_independent_permutations_are_the_old_draws(seed):
    """"independent" draws one permutation per explored (axis, group) in sorted order
    from torch.Generator().manual_seed(seed), at construction and at every sync: the
    pre-redesign sequence, redrawn here by hand."""
    R, T, N = 4, 3, 30
    axes = {"lr": {"spread_ratio": 0.2}, "weight_decay": {"spread_ratio": 0.3}}
    cfg = config(replicas=R, sync_interval=T, total_steps=N, seed=seed, axes=axes,
                 auto={"groups": "independent", "fitness": "train_loss"})
    sch, _, _ = make(cfg)
    gen = torch.Generator().manual_seed(seed)
    keys = [("lr", 0), ("lr", 1), ("weight_decay", 0), ("weight_decay", 1)]

    def draw():
        return {k: torch.randperm(R, generator=gen).tolist() for k in keys}

    want = draw()
    differ = False
    for t in range(N):
        assert sch.permutations == want, t
        differ |= want[("lr", 0)] != want[("lr", 1)]
        sch.step([1.0, 1.2, 0.9, 1.1])
        if (t + 1) % T == 0:
            want = draw()
    assert differ  # the groups of one axis really get different permutations


def test_tied_permutations_one_draw_per_axis():
    R, seed = 4, 7
    axes = {"lr": {"spread_ratio": 0.2}, "weight_decay": {"spread_ratio": 0.3}}
    cfg = config(replicas=R, sync_interval=3, total_steps=12, seed=seed, axes=axes, auto={"fitness": "train_loss"})
    sch, _, _ = make(cfg)
    gen = torch.Generator().manual_seed(seed)
    for t in range(12):
        if t % 3 == 0:
            p_lr, p_wd = (torch.randperm(R, generator=gen).tolist() for _ in range(2))
        assert sch.permutations == {("lr", 0): p_lr, ("lr", 1): p_lr, ("weight_decay", 0): p_wd,
                                    ("weight_decay", 1): p_wd}, t
        sch.step([1.0, 1.2, 0.9, 1.1])


# ---- probe fitness in the scheduler --------------------------------------------------------

def test_probe_fitness_overrides_training_loss_and_is_logged():
    """Training losses favour replica 1, the probe replica 0: the update follows the probe."""
    cfg = config(replicas=2, sync_interval=4, total_steps=20, seed=2)
    sch, _, sync = make(cfg)
    sch.set_probe(lambda: [1.0, 2.0])
    perm = list(sch.permutations[("lr", 0)])
    for _ in range(4):
        sch.step([3.0, 1.0])
    w0 = 1 / (1 + math.exp(-2.0))
    off = [-1.0, 1.0]
    g = w0 * off[perm[0]] + (1 - w0) * off[perm[1]]
    assert sch.last_sync["hdet/lr/group_0/hypergradient"] == pytest.approx(g, rel=1e-12)
    assert sch.last_sync["hdet/weight/replica_0"] == pytest.approx(w0, rel=1e-12)
    assert (sch.last_sync["hdet/fitness/replica_0"], sch.last_sync["hdet/fitness/replica_1"]) == (1.0, 2.0)
    assert (sch.last_sync["hdet/loss/replica_0"], sch.last_sync["hdet/loss/replica_1"]) == (3.0, 1.0)
    assert sync.converge_calls == [[True, True]]


def test_nonfinite_probe_loss_leaves_the_replica_out():
    cfg = config(replicas=2, sync_interval=2, total_steps=10)
    sch, _, sync = make(cfg)
    sch.set_probe(lambda: [NAN, 2.0])
    sch.step([1.0, 1.0])
    sch.step([1.0, 1.0])
    assert sync.converge_calls == [[False, True]]
    assert sch.last_sync["hdet/nonfinite_replicas"] == [0]
    assert sch.last_sync["hdet/weight/replica_0"] == 0.0 and sch.last_sync["hdet/weight/replica_1"] == 1.0


def test_a_probe_with_no_finite_value_warns_once_that_nothing_moved():
    """A probe returning NaN for every replica at every sync (the weights all 0, the
    multiplier held) does not run without a word: one warning names it."""
    import warnings

    cfg = config(replicas=2, sync_interval=2, total_steps=20)
    sch, _, _ = make(cfg)
    sch.set_probe(lambda: [NAN, NAN])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            sch.step([1.0, 1.0])
    said = [w for w in caught if "no replica had a finite fitness" in str(w.message)]
    assert len(said) == 2 and sch.last_sync["hdet/weight/replica_0"] == 0.0  # "always": once per meta-update here
    assert sch.last_sync["hdet/lr/group_0/multiplier"] == 1.0
    sch.set_probe(lambda: [1.0, 2.0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sch.step([1.0, 1.0])
        sch.step([1.0, 1.0])
    assert not [w for w in caught if "no replica had a finite fitness" in str(w.message)]


def test_probe_fitness_missing_probe_raises_at_first_meta_update():
    cfg = config(replicas=2, sync_interval=2, total_steps=10)
    sch, _, _ = make(cfg)
    with pytest.raises(HDETConfigError, match="hdet.auto.fitness"):
        sch.check_probe()
    sch.step([1.0, 1.0])
    with pytest.raises(HDETConfigError, match="hdet.auto.fitness"):
        sch.step([1.0, 1.0])


# ---- state ----------------------------------------------------------------------------------

@pytest.mark.parametrize("cut", [7, 10])
def test_log_controller_state_dict_resume_is_exact(cut):
    T, N = 5, 40
    axes = {"lr": {"spread_ratio": 0.2}, "weight_decay": {"spread_ratio": 0.02, "kind": "additive", "auto": True}}
    cfg = config(replicas=3, sync_interval=T, total_steps=N, axes=axes)

    def probe_for(sch):
        return lambda: [1.0 + 0.1 * math.sin(sch.step_count + r) for r in range(3)]

    def run(sch, groups, t0, t1):
        out = []
        for t in range(t0, t1):
            sch.step([1.0, 1.1, 1.2])
            out.append(({r: [(g["lr"], g["weight_decay"]) for g in gs] for r, gs in groups.items()},
                        dict(sch.controller.log_m), dict(sch.velocity), copy.deepcopy(sch.permutations)))
        return out

    ref, ref_groups, _ = make(cfg, wds=(0.05, 0.03))
    ref.set_probe(probe_for(ref))
    ref_trace = run(ref, ref_groups, 0, N)
    a, a_groups, _ = make(cfg, wds=(0.05, 0.03))
    a.set_probe(probe_for(a))
    run(a, a_groups, 0, cut)
    state = copy.deepcopy(a.state_dict())
    assert state["version"] == 2 and set(state["controller"]) == {"base", "log_m", "velocity", "updates"}
    b, b_groups, _ = make(cfg, wds=(0.05, 0.03))
    b.set_probe(probe_for(b))
    b.load_state_dict(state)
    assert b_groups == a_groups
    assert run(b, b_groups, cut, N) == ref_trace[cut:]
    assert ref.controller.log_m[("lr", 0)] != 0.0 and ref.controller.log_m[("weight_decay", 0)] != 0.0


# ---- decay and the drowning warning ------------------------------------------------------

def test_decay_for_is_zero_for_log_controller():
    cfg = config(replicas=2, sync_interval=2, total_steps=10)
    assert decay_for(cfg, build_schedule(cfg), "lr", 0.1) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a short paper run: the drowning warning
        paper = config(replicas=2, sync_interval=2, total_steps=10, auto=PAPER)
    # paper, derived: floor/start = (peak/25/1e4) / OneCycle(2) over K = 5 syncs (2, 4, ..., 10)
    oc = OneCycle(total_steps=10)
    want = 1 - (oc.floor(1.0) / oc.value(2, 1.0)) ** (1 / 5)
    assert decay_for(paper, build_schedule(paper), "lr", 1.0) == pytest.approx(want, rel=1e-12)


def _cosine_paper(total_steps, spread=0.2):
    return HDETConfig.from_dict({"replicas": 2, "sync_interval": 2, "axes": {"lr": {"spread_ratio": spread}},
                                 "schedule": {"name": "cosine", "total_steps": total_steps, "min_ratio": 0.1},
                                 "auto": {"enabled": True, **PAPER}})


def test_drowning_warning_threshold_by_hand():
    """Cosine without warm-up from the first sync at step 2 to the floor 0.1 * peak over
    K syncs: gamma = 1 - (0.1 / cos_value(2)) ** (1 / K). It warns iff gamma > step_size
    * spread_ratio = 0.5 * 0.2 = 0.1."""
    cfg = _cosine_paper(200)
    assert drowning_warning(cfg, 0.1) is None
    msg = drowning_warning(cfg, 0.1000001)
    assert msg is not None and "10.0% per sync" in msg and "controller='log'" in msg
    for total, warns in ((10, True), (200, False)):
        cfg = _cosine_paper(total)
        sched = build_schedule(cfg)
        K = total // 2  # syncs at 2, 4, ..., total
        start = 0.1 + 0.9 * (1 + math.cos(math.pi * 2 / total)) / 2  # half-cosine from 1 to 0.1, peak 1
        gamma = 1 - (0.1 / start) ** (1 / K)
        assert decay_for(cfg, sched, "lr", 1.0) == pytest.approx(gamma, rel=1e-12)
        assert (gamma > 0.1) == warns
        assert (drowning_warning(cfg, decay_for(cfg, sched, "lr", 1.0)) is not None) == warns


def test_drowning_warning_fires_for_short_paper_run_only():
    with pytest.warns(UserWarning, match="piecewise-constant decay"):
        make(_cosine_paper(10), lrs=(0.1,), wds=(0.0,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(_cosine_paper(200), lrs=(0.1,), wds=(0.0,))  # long run: no warning
        # the log controller never warns, however short the run
        make(HDETConfig.from_dict({"replicas": 2, "sync_interval": 2, "axes": {"lr": {"spread_ratio": 0.2}},
                                   "schedule": {"name": "cosine", "total_steps": 10},
                                   "auto": {"enabled": True, "fitness": "train_loss"}}), lrs=(0.1,), wds=(0.0,))


# ---- robustness of the probe and the auto-LR set-up -------------------------------------

def _sim_block(**auto):
    return {"replicas": 2, "sync_interval": 2, "axes": {"lr": {"spread_ratio": 0.2}},
            "schedule": {"name": "constant", "total_steps": 8}, "auto": {"enabled": True, **auto}}


def _tiny():
    return torch.nn.Linear(2, 1)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("probe_fn,needle", [
    (lambda model: 0.0, "probe_fn(model, r)"),      # the backends' one-argument form
    (3.0, "expected a function"),
])
def test_simulator_probe_signature_checked_at_construction(probe_fn, needle):
    from hdet_scale import Simulator

    with pytest.raises(HDETConfigError, match=re.escape(needle)):
        Simulator(_tiny, _sgd, _sim_block(), probe_fn=probe_fn)


# a 1-D tensor is per-example losses (test_iterates); two dimensions or none are refused
@pytest.mark.parametrize("bad", [[1.0, 2.0], "1.0", None, torch.ones(2, 2), torch.ones(0)])
def test_bad_probe_result_is_a_config_error_naming_the_probe(bad):
    from hdet_scale import Simulator

    sim = Simulator(_tiny, _sgd, _sim_block(), probe_fn=lambda model, r: bad)
    x = torch.ones(4, 2)
    sim.step(lambda m, r: m(x).pow(2).mean())
    with pytest.raises(HDETConfigError, match="probe: must return"):
        sim.step(lambda m, r: m(x).pow(2).mean())


@pytest.mark.parametrize("block", [
    {"axes": {"lr": {"spread_ratio": 0.0}}},
    {"replicas": 1},
])
def test_auto_lr_without_signal_warns_and_needs_no_probe(block):
    """Spread 0 or one replica: nothing to compare, so a warning and no probe needed
    (the Simulator would otherwise refuse the missing probe_fn)."""
    from hdet_scale import Simulator

    with pytest.warns(UserWarning, match="no signal"):
        sim = Simulator(_tiny, _sgd, {**_sim_block(), **block})
    x = torch.ones(4, 2)
    for _ in range(4):
        sim.step(lambda m, r: m(x).pow(2).mean())
    assert sim.scheduler.controller.log_m[("lr", 0)] == 0.0


def test_resume_with_another_controller_or_group_mode_is_refused():
    from hdet_scale import Simulator

    probe = lambda model, r: float(r)  # noqa: E731
    sim = Simulator(_tiny, _sgd, _sim_block(), probe_fn=probe)
    x = torch.ones(4, 2)
    for _ in range(3):
        sim.step(lambda m, r: m(x).pow(2).mean())
    state = sim.state_dict()
    for other in ({"controller": "paper", "fitness": "train_loss"}, {"groups": "independent"}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fresh = Simulator(_tiny, _sgd, _sim_block(**other), probe_fn=probe)
        with pytest.raises(HDETStateError, match="resume with the same value"):
            fresh.load_state_dict(state)
